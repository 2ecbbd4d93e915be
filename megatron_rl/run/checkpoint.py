"""Trainer checkpoints: everything needed to continue a run (bit for bit with the transformers engine,
whose sampling is seeded per step; SGLang's is not outside its deterministic mode).

Layout of ``trainer.default_local_dir``::

    latest_checkpointed_iteration.txt      newest complete step (written last, atomically)
    checkpoint_order.txt                    the global_step_N directories in the order they were
                                            published (oldest first), across runs: pruning reads it
    run.lock                                held (flock) by rank 0 of the run using the directory;
                                            it says which host, pid and start time
    global_step_{N}/
        trainer_state.json                  step, sampler position, KL controller, layout, the step's
                                            metrics row (written to metrics.jsonl on resume if a death
                                            between the publish and the row lost it)
        actor/  critic/                     model weights, megatron-core torch_dist (any TP/PP loads them;
                                            ckpt_tools mcore-to-hf exports them), with the tokenizer
                                            and generation_config.json files of the run's model
        actor_optim/  critic_optim/         optimizer states (fp32 main weights, Adam's moments), megatron's
                                            sharded optimizer state dict in torch_dist: each DP rank writes
                                            its shard of the distributed optimizer; any DP size loads it
        mp_rank_{tp:02d}_{pp:03d}.pt        LR-schedule positions and RNG states of one model shard
                                            (written by data-parallel rank 0)
        checksums.json                      size and SHA-256 of every file above (written last, checked first)

A save writes into ``.global_step_{N}.partial`` and is published by one rename after every rank
has written, so a crash mid-save never leaves a directory that looks complete; a run removes the
partial directories an earlier run left (under the lock, so never another live run's). Only the
newest ``trainer.max_ckpt_to_keep`` are kept, newest by publication order (not by step number: a
fresh run in an old directory starts again at low steps), and never the one just written or the one
the run resumed from. Files are written with ``trainer.checkpoint_permissions`` (default 0600,
directories 0700). Resuming needs the same TP/PP layout (optimizer states are per model shard) but
may change the number of data-parallel replicas; the directory must be on a filesystem every node
sees.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.errors import COLLATERAL, CheckpointError
from megatron_rl.models.chunks import num_chunks
from megatron_rl.parallel import ParallelState
from megatron_rl.run.ckpt_files import (
    STEP_DIR,
    DirLock,
    any_rank,
    chmod_tree,
    is_disk_full,
    open_private,
    parse_permissions,
    remove_leftovers,
    verify_digests,
    write_atomic,
    write_digests,
)
from megatron_rl.weights.hf_io import copy_side_files
from megatron_rl.weights.safe_load import safe_dist_load, safe_torch_load

log = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"
ORDER_FILE = "checkpoint_order.txt"
SHARED_FILE = "shared_state.pt"
"""Rank 0's state that every rank reads on resume (the separate rollout's queued generations)."""
_SAVE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)
"""What a failed write raises: torch DCP gathers every rank's write failures (a full disk included) into
a CheckpointException, which is a BaseException, not an Exception."""


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import random as mrandom

    np_state = np.random.get_state(legacy=True)  # the global RandomState's MT19937: a tuple
    assert isinstance(np_state, tuple), type(np_state)
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


def _layout(ps: ParallelState, models=()) -> dict[str, int]:  # vpp (chunks per stage) where > 1
    vpp = {"vpp": n} if (n := max(map(num_chunks, models), default=1)) > 1 else {}
    return {"tp": ps.tp_size, "pp": ps.pp_size, **vpp, "dp": ps.dp_size, "world_size": ps.world_size}


def experts_modules(models: dict[str, torch.nn.Module]) -> dict[str, str]:
    """{name: "grouped" | "sequential"} of the MoE models: GroupedExperts holds one parameter per
    projection, SequentialMLP one per expert: optimizer states differ (weights load either way)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_rl.models.experts import GroupedExperts

    out = {}
    for name, model in models.items():
        kinds = {type(m) for m in model.modules()}
        if GroupedExperts in kinds:
            out[name] = "grouped"
        elif SequentialMLP in kinds:
            out[name] = "sequential"
    return out


def _shard_file(path: str, ps: ParallelState) -> str:
    return os.path.join(path, f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}.pt")


def write_in_process() -> None:
    """Make megatron-core's torch_dist writer hand its results back through an in-process queue.

    Its default is a ``multiprocessing`` Manager queue, which starts two processes of its own (the
    manager's server and its resource tracker) at the first save, in the rank's process group. torchrun
    delivers a stop signal to that whole group, so a SIGTERM / SIGUSR1 / SIGUSR2 after the first save
    killed the server and, with it, the save of the step the signal asked to keep; a ``kill -9`` of the
    rank left both behind for minutes. Our saves are synchronous (the writer's function runs in this
    process), so a plain queue carries the results and no helper process exists."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


# --------------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------------


class CheckpointManager:
    def __init__(
        self,
        root: str,
        ps: ParallelState,
        max_to_keep: int | None = None,
        side_file_dirs: tuple[str, ...] = (),
        permissions: str | int | None = "0600",
        claim: bool = False,
    ) -> None:
        """``side_file_dirs``: where the tokenizer and generation-config files are (the first that has
        any); each saved model directory gets a copy, so that an export is a complete HF model.
        ``permissions``: octal mode of the files written (directories get the matching search bits).
        ``claim``: take the directory for this run now (collective, see :meth:`claim`)."""
        self.root = root
        self.ps = ps
        self.max_to_keep = max_to_keep
        self.side_file_dirs = side_file_dirs
        self.file_mode, self.dir_mode = parse_permissions(permissions)
        self.resumed_from: str | None = None
        """Set by the trainer after it resumed: pruning never deletes that checkpoint."""
        self.lock: DirLock | None = None
        if claim:
            self.claim()

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    # ---------------------------------------------------------------------------------- start of a run

    def claim(self) -> None:
        """Collective: rank 0 locks the directory for the life of this process and removes what runs
        that stopped mid-save or mid-prune left behind; every rank raises the same one-line
        :class:`CheckpointError` if another run holds the lock."""
        error = None
        if self.ps.rank == 0:
            try:
                self._make_root()
                self.lock = DirLock(self.root, self.file_mode)
                self.lock.acquire()
                remove_leftovers(self.root)
            except CheckpointError as e:
                error = str(e)
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise CheckpointError(error)

    def release(self) -> None:
        """Give the directory lock back (it also goes when the process exits)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _make_root(self) -> None:
        if not os.path.isdir(self.root):
            os.makedirs(self.root, exist_ok=True)
            os.chmod(self.root, self.dir_mode)  # ours: private like the checkpoints in it

    # ---------------------------------------------------------------------------------- finding

    def latest(self) -> str | None:
        """The newest complete checkpoint under root, or None (lenient: see :meth:`resume_path`)."""
        try:
            return self.resume_path()
        except CheckpointError:
            return None

    def resume_path(self) -> str | None:
        """The checkpoint ``resume_mode=auto`` continues from: the one the tracker names; None for a
        directory with no tracker and no checkpoint. A tracker that is unreadable, holds no step
        number or names a missing checkpoint, or checkpoints without a tracker, raise a one-line
        :class:`CheckpointError` instead of silently starting over at step 0."""
        tracker = os.path.join(self.root, LATEST)
        fix = (
            "set trainer.resume_mode=resume_path and trainer.resume_from_path to an existing "
            f"{self.root}/global_step_N, or start over with trainer.resume_mode=disable"
        )
        if not os.path.exists(tracker):
            steps = self._step_dirs()
            if not steps:
                return None
            raise CheckpointError(
                f"{self.root} holds checkpoints ({', '.join(steps[-3:])}) but no {LATEST}: to resume, "
                f"set trainer.resume_mode=resume_path trainer.resume_from_path={self.root}/{steps[-1]} "
                "(or write its step number into the tracker); to start over, trainer.resume_mode=disable."
            )
        try:
            with open(tracker) as f:
                text = f.read(200)
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"cannot read the checkpoint tracker {tracker} ({e}): fix or delete it, or {fix}."
            ) from None
        if not re.fullmatch(r"\s*\d+\s*", text):
            shown = repr(text.strip()[:40]) if text.strip() else "nothing"
            raise CheckpointError(
                f"the checkpoint tracker {tracker} holds {shown}, not a step number: write the step of an "
                f"existing global_step_N into it (or delete it), or {fix}."
            )
        path = self.step_dir(int(text))
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            why = "is incomplete (no trainer_state.json)" if os.path.isdir(path) else "does not exist"
            raise CheckpointError(
                f"the checkpoint tracker {tracker} names {path}, which {why}: write the step of an existing "
                f"global_step_N into the tracker (or delete it), or {fix}."
            )
        return path

    def _step_dirs(self) -> list[str]:
        """global_step_N directory names, by step."""
        if not os.path.isdir(self.root):
            return []
        found = [(int(m.group(1)), d) for d in os.listdir(self.root) if (m := STEP_DIR.match(d))]
        return [d for _, d in sorted(found) if os.path.isdir(os.path.join(self.root, d))]

    # ---------------------------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        models: dict[str, torch.nn.Module],
        optimizers: dict[str, Any],
        shards: dict[str, Any],
        trainer_state: dict[str, Any],
        shared: dict[str, Any] | None = None,
        before_publish: Callable[[str], None] | None = None,
    ) -> str:
        """Collective: every rank passes the models, their optimizers (``ModelOptimizer`` by the model's
        name) and its shard's state dicts; rank 0 publishes, with ``shared`` (the same on every rank:
        plain lists, numbers and strings) in shared_state.pt. ``before_publish(partial_dir)`` runs on
        every rank after they have written (a critic on ranks of its own writes its part then).

        A write that fails on any rank (a full disk included) fails the save on every rank: the
        partial directory is removed, the tracker and earlier checkpoints are left as they were, and
        a full disk is reported in one line naming ENOSPC and the path.
        """
        from megatron_rl.weights.ckpt_write import save_torch_dist

        ps = self.ps
        write_in_process()
        final = self.step_dir(step)
        partial = os.path.join(self.root, f".global_step_{step}.partial")
        error: BaseException | None = None
        try:
            if ps.rank == 0:
                self._make_root()
                shutil.rmtree(partial, ignore_errors=True)
                os.mkdir(partial, self.dir_mode)
        except OSError as e:
            error = e
        if any_rank(error is not None):
            raise self._save_failed(error, partial, final)
        try:
            # torch DCP gathers write failures, so a rank that cannot write fails these on every rank
            for name, model in models.items():
                save_torch_dist(model, ps, os.path.join(partial, name))
                if ps.rank == 0:
                    copy_side_files(list(self.side_file_dirs), os.path.join(partial, name))
            for name, opt in optimizers.items():
                save_optimizer(opt, ps, os.path.join(partial, f"{name}_optim"))
            if ps.dp_rank == 0:
                with open_private(_shard_file(partial, ps), self.file_mode) as f:
                    torch.save({**shards, "rng": rng_state()}, f)
            if ps.rank == 0 and shared:
                with open_private(os.path.join(partial, SHARED_FILE), self.file_mode) as f:
                    torch.save(shared, f)
            if ps.rank == 0:
                with open_private(os.path.join(partial, "trainer_state.json"), self.file_mode, False) as f:
                    experts = experts_modules(models)  # mixture-of-experts models only
                    layout = {**_layout(ps, models.values()), **({"experts": experts} if experts else {})}
                    json.dump({**trainer_state, "global_step": step, "layout": layout}, f, indent=1)
        except _SAVE_ERRORS as e:  # any rank's failure must reach every rank, or they wait at the barrier
            error = e
        if before_publish is not None and not any_rank(error is not None):
            try:
                before_publish(partial)  # collective on every rank, so only once all have written
            except _SAVE_ERRORS as e:
                error = e
        if not any_rank(error is not None):
            try:
                write_digests(partial, self.file_mode)  # collective; the manifest is the last file written
                if ps.rank == 0:
                    self._publish(partial, final, step)
            except Exception as e:
                error = e
            if not any_rank(error is not None):
                return final
        raise self._save_failed(error, partial, final)

    def _save_failed(self, error: BaseException | None, partial: str, final: str) -> BaseException:
        """Clean up after a failed save (rank 0) and return what this rank raises."""
        full = is_disk_full(error, self.root) if error is not None else False
        if self.ps.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        previous = self.latest() or "none yet"
        if full:
            return CheckpointError(
                f"no space left on device (ENOSPC) while saving {final} (writing {partial}): free space on "
                f"that filesystem or point trainer.default_local_dir at a larger one; the partial save was "
                f"removed and earlier checkpoints are untouched (latest: {previous}).",
                same_on_all_ranks=False,
            )
        if error is None:
            return CheckpointError(
                f"saving {final} failed on another rank ({COLLATERAL}); the partial save was removed.",
                same_on_all_ranks=False,
            )
        return error

    def _publish(self, partial: str, final: str, step: int) -> None:
        """Rank 0, after every rank wrote: permissions, one rename, tracker, order file, pruning."""
        chmod_tree(partial, self.file_mode, self.dir_mode)
        if os.path.isdir(final):  # the same step saved again (a resumed run): the new one wins
            old = os.path.join(self.root, f".global_step_{step}.deleting")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(partial, final)
        write_atomic(os.path.join(self.root, LATEST), f"{step}\n", self.file_mode)
        name = os.path.basename(final)
        order = [d for d in self._publication_order() if d != name] + [name]
        order = self._prune(order, keep={name})
        write_atomic(os.path.join(self.root, ORDER_FILE), "".join(f"{d}\n" for d in order), self.file_mode)

    def _publication_order(self) -> list[str]:
        """Checkpoint directory names, oldest publication first: those not in the order file (written
        by an older version, or copied in) by modification time, then the order file's, in its order."""
        listed: list[str] = []
        with contextlib.suppress(OSError, UnicodeDecodeError):
            with open(os.path.join(self.root, ORDER_FILE)) as f:
                for line in f:
                    d = line.strip()
                    if STEP_DIR.match(d):
                        listed = [x for x in listed if x != d] + [d]
        present = set(self._step_dirs())
        unknown = sorted(
            present - set(listed),
            key=lambda d: (os.path.getmtime(os.path.join(self.root, d)), int(d.rsplit("_", 1)[1])),
        )
        return unknown + [d for d in listed if d in present]

    def _prune(self, order: list[str], keep: set[str]) -> list[str]:
        """Delete all but the newest ``max_to_keep`` of ``order`` (and ``keep`` and the checkpoint the
        run resumed from); returns what is left, in order. A deletion renames first, so a crash
        mid-delete leaves a ``.deleting`` directory (removed at the next start), never a torn
        global_step_N."""
        if not self.max_to_keep or self.max_to_keep < 1:
            return order
        keep = set(keep) | set(order[-self.max_to_keep :])
        if self.resumed_from:
            keep.add(os.path.basename(os.path.normpath(self.resumed_from)))
        left = []
        for d in order:
            if d in keep:
                left.append(d)
                continue
            doomed = os.path.join(self.root, f".{d}.deleting")
            shutil.rmtree(doomed, ignore_errors=True)
            os.rename(os.path.join(self.root, d), doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            where = os.path.join(self.root, d)
            log.info("removed checkpoint %s (trainer.max_ckpt_to_keep=%d)", where, self.max_to_keep)
        return left

    def load(
        self, path: str, models: dict[str, torch.nn.Module], optimizers: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Fill ``models`` and ``optimizers`` and return (this rank's shards, trainer_state); RNG states
        are restored too."""
        from megatron_rl.weights.torch_dist import load_torch_dist

        state_file = os.path.join(path, "trainer_state.json")
        if not os.path.isfile(state_file):
            raise CheckpointError(
                f"{path} is not a complete checkpoint (no trainer_state.json): point "
                "trainer.resume_from_path at an existing global_step_N directory."
            )
        verify_digests(path)  # collective: every file against checksums.json before any is read
        with open(state_file) as f:
            trainer_state = json.load(f)
        saved, now = trainer_state["layout"], _layout(self.ps, models.values())
        was, runs = ((x["tp"], x["pp"], x.get("vpp", 1)) for x in (saved, now))
        if was != runs:
            raise RuntimeError(
                f"Checkpoint {path} was saved at TP/PP/VPP={'/'.join(map(str, was))}, this job runs "
                f"{'/'.join(map(str, runs))}: resume with the same actor_rollout_ref.actor.megatron "
                "parallel sizes (DP may change), or start from its weights (trainer.resume_mode=disable)."
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
        # checkpoints from before grouped experts held SequentialMLP experts
        saved_experts = saved.get("experts", dict.fromkeys(experts_modules(models), "sequential"))
        for name, kind in experts_modules(models).items():
            if name in optimizers and saved_experts.get(name, kind) != kind:
                raise RuntimeError(
                    f"Checkpoint {path} holds the {name}'s optimizer state of {saved_experts[name]} experts, "
                    f"this job builds {kind} ones (laid out differently): resume with "
                    "*.megatron.override_transformer_config.moe_grouped_gemm="
                    f"{str(saved_experts[name] == 'grouped').lower()}, or start from its weights (the "
                    f"{name}'s model.path={os.path.join(path, name)}, trainer.resume_mode=disable)."
                )
        for name, model in models.items():
            if not os.path.isdir(os.path.join(path, name)):
                raise FileNotFoundError(
                    f"{path} has no {name}/: resume with the same algorithm (critic.enable)."
                )
            load_torch_dist(model, self.ps, os.path.join(path, name))
        for name, opt in optimizers.items():
            load_optimizer(opt, os.path.join(path, f"{name}_optim"))
        shards = safe_torch_load(_shard_file(path, self.ps))
        set_rng_state(shards.pop("rng"))
        shared = os.path.join(path, SHARED_FILE)
        if os.path.isfile(shared):
            trainer_state["shared"] = safe_torch_load(shared)
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
    state = opt.sharded_state_dict(opt.model.sharded_state_dict(), is_loading=True)
    opt.load_sharded_state_dict(safe_dist_load(state, path))
