"""Trainer checkpoints: everything needed to continue a run bit for bit.

Layout of ``trainer.default_local_dir``::

    latest_checkpointed_iteration.txt      newest complete step (written last, atomically)
    global_step_{N}/
        trainer_state.json                  step, sampler position, KL controller, layout
        actor/  critic/                     model weights, megatron-core torch_dist (any TP/PP loads them;
                                            ckpt_tools mcore-to-hf exports them), with the tokenizer
                                            and generation_config.json files of the run's model
        actor_optim/  critic_optim/         optimizer states (fp32 main weights, Adam's moments), megatron's
                                            sharded optimizer state dict in torch_dist: each DP rank writes
                                            its shard of the distributed optimizer; any DP size loads it
        mp_rank_{tp:02d}_{pp:03d}.pt        LR-schedule positions and RNG states of one model shard
                                            (written by data-parallel rank 0)

A save writes into ``.global_step_{N}.partial`` and is published by one rename after every rank
has written, so a crash mid-save never leaves a directory that looks complete. Only the newest
``trainer.max_ckpt_to_keep`` are kept. Resuming needs the same TP/PP layout (optimizer states are
per model shard) but may change the number of data-parallel replicas; the directory must be on a
filesystem every node sees.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.parallel import ParallelState
from megatron_rl.weights.hf_io import copy_side_files

LATEST = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import random as mrandom

    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "megatron": mrandom.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    mrandom.get_cuda_rng_tracker().set_states(state["megatron"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _layout(ps: ParallelState) -> dict[str, int]:
    return {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size, "world_size": ps.world_size}


def _shard_file(path: str, ps: ParallelState) -> str:
    return os.path.join(path, f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}.pt")


class CheckpointManager:
    def __init__(
        self,
        root: str,
        ps: ParallelState,
        max_to_keep: int | None = None,
        side_file_dirs: tuple[str, ...] = (),
    ) -> None:
        """``side_file_dirs``: where the tokenizer and generation-config files are (the first that has
        any); each saved model directory gets a copy, so that an export is a complete HF model."""
        self.root = root
        self.ps = ps
        self.max_to_keep = max_to_keep
        self.side_file_dirs = side_file_dirs

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def latest(self) -> str | None:
        """The newest complete checkpoint under root, or None."""
        f = os.path.join(self.root, LATEST)
        if not os.path.isfile(f):
            return None
        with open(f) as fh:
            path = self.step_dir(int(fh.read().strip()))
        return path if os.path.isdir(path) else None

    def save(
        self,
        step: int,
        models: dict[str, torch.nn.Module],
        optimizers: dict[str, Any],
        shards: dict[str, Any],
        trainer_state: dict[str, Any],
    ) -> str:
        """Collective: every rank passes the models, their optimizers (``ModelOptimizer`` by the model's
        name) and its shard's state dicts; rank 0 publishes."""
        from megatron_rl.weights.megatron_ckpt import save_torch_dist

        ps = self.ps
        final = self.step_dir(step)
        partial = os.path.join(self.root, f".global_step_{step}.partial")
        if ps.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        dist.barrier()
        for name, model in models.items():
            save_torch_dist(model, ps, os.path.join(partial, name))
            if ps.rank == 0:
                copy_side_files(list(self.side_file_dirs), os.path.join(partial, name))
        for name, opt in optimizers.items():
            save_optimizer(opt, ps, os.path.join(partial, f"{name}_optim"))
        if ps.dp_rank == 0:
            torch.save({**shards, "rng": rng_state()}, _shard_file(partial, ps))
        if ps.rank == 0:
            with open(os.path.join(partial, "trainer_state.json"), "w") as f:
                json.dump({**trainer_state, "global_step": step, "layout": _layout(ps)}, f, indent=1)
        dist.barrier()
        if ps.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)
            tmp = os.path.join(self.root, LATEST + ".tmp")
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, os.path.join(self.root, LATEST))
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        if not self.max_to_keep:
            return
        steps = sorted(int(m.group(1)) for d in os.listdir(self.root) if (m := _STEP_DIR.match(d)))
        for s in steps[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)

    def load(
        self, path: str, models: dict[str, torch.nn.Module], optimizers: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Fill ``models`` and ``optimizers`` and return (this rank's shards, trainer_state); RNG states
        are restored too."""
        from megatron_rl.weights.megatron_ckpt import load_torch_dist

        state_file = os.path.join(path, "trainer_state.json")
        if not os.path.isfile(state_file):
            raise FileNotFoundError(
                f"{path} is not a complete checkpoint (no trainer_state.json): check trainer.resume_from_path"
            )
        with open(state_file) as f:
            trainer_state = json.load(f)
        saved, now = trainer_state["layout"], _layout(self.ps)
        if (saved["tp"], saved["pp"]) != (now["tp"], now["pp"]):
            raise RuntimeError(
                f"Checkpoint {path} was saved at TP={saved['tp']} PP={saved['pp']}, this job runs "
                f"TP={now['tp']} PP={now['pp']}: resume with the same actor_rollout_ref.actor.megatron "
                "parallel sizes (the data-parallel size may change), or set trainer.resume_mode=disable."
            )
        for name in optimizers:
            if os.path.isdir(os.path.join(path, name)) and not os.path.isdir(
                os.path.join(path, f"{name}_optim")
            ):
                raise RuntimeError(
                    f"{path} holds no {name}_optim/ (written before optimizer states were sharded): resume "
                    f"its weights only with actor_rollout_ref.model.path={os.path.join(path, 'actor')} and "
                    "critic.model.path=.../critic (Adam restarts), and trainer.resume_mode=disable."
                )
        for name, model in models.items():
            if not os.path.isdir(os.path.join(path, name)):
                raise FileNotFoundError(
                    f"{path} has no {name}/: resume with the same algorithm (critic.enable)."
                )
            load_torch_dist(model, self.ps, os.path.join(path, name))
        for name, opt in optimizers.items():
            load_optimizer(opt, os.path.join(path, f"{name}_optim"))
        shards = torch.load(_shard_file(path, self.ps), map_location="cpu", weights_only=True)
        set_rng_state(shards.pop("rng"))
        return shards, trainer_state


def save_optimizer(opt: Any, ps: ParallelState, path: str) -> None:
    """Write ``opt``'s sharded state (megatron's optimizer sharded_state_dict) into ``path``. Collective."""
    from megatron.core import dist_checkpointing

    if ps.rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(opt.sharded_state_dict(opt.model.sharded_state_dict()), path)
    dist.barrier()


def load_optimizer(opt: Any, path: str) -> None:
    """Fill ``opt`` from :func:`save_optimizer`'s directory, at any data-parallel size. Collective."""
    from megatron.core import dist_checkpointing

    from megatron_rl.weights.megatron_ckpt import safe_globals

    state = opt.sharded_state_dict(opt.model.sharded_state_dict(), is_loading=True)
    with torch.serialization.safe_globals(safe_globals()):
        opt.load_sharded_state_dict(dist_checkpointing.load(state, path))
