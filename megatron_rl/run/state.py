"""The registry of everything a checkpoint holds: each piece of state is registered once, by name, with
where it goes on disk; ``save`` and ``load`` walk the registry (``resume``: ``load`` of the checkpoint
trainer.resume_mode names; run/checkpoint.CheckpointManager does the writing, publishing and file
layout).

    registry.register("sampler", sampler)                 trainer_state.json["sampler"] (rank 0 writes,
                                                          every rank reads; JSON values)
    registry.register("rollout_queue", q, SHARED)         shared_state.pt["rollout_queue"] (collective
                                                          state_dict, None = nothing to keep)
    registry.register("critic_optim", c, SHARD)           mp_rank_XX_YYY.pt["critic_optim"] (one model
                                                          shard's state, written by DP rank 0)
    registry.register_model("actor", model, optim)        actor/ and actor_optim/ (torch_dist) and the
                                                          optimizer's counters in the shard files
    registry.register_files("critic", c)                  files another world writes into the partial
                                                          checkpoint before it is published (a critic
                                                          on ranks of its own) and reads on resume

A new piece of state is one ``register`` call where its owner is built (roles/build.py); nothing else
changes. Loading restores in registration order, trainer_state.json's pieces first (cheap, and a
mismatch such as other training data stops the run before any weights are read).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from megatron_rl.errors import CheckpointError
from megatron_rl.run.ckpt_files import verify_digests

if TYPE_CHECKING:
    from megatron_rl.config import TrainerConfig

log = logging.getLogger(__name__)

TRAINER: Literal["trainer"] = "trainer"
SHARED: Literal["shared"] = "shared"
SHARD: Literal["shard"] = "shard"
Where = Literal["trainer", "shared", "shard"]


@runtime_checkable
class Stateful(Protocol):
    """What the registry saves and restores: a plain (JSON- or torch.save-able) state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@runtime_checkable
class CheckpointFiles(Protocol):
    """State written as files by someone else (e.g. the critic ranks) into the checkpoint directory."""

    def save_files(self, partial_dir: str) -> None: ...

    def load_files(self, path: str) -> None: ...


class Value:
    """A fixed value saved with the checkpoint and checked before anything else loads:
    ``check(saved, path)`` raises on a mismatch (e.g. the training data's fingerprint)."""

    def __init__(self, value: Any, check: Callable[[Any, str], None] | None = None) -> None:
        self.value, self.check = value, check

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        pass  # a fixed value: nothing to restore (verify checks it)

    def verify(self, saved: Any, path: str) -> None:
        if self.check is not None and saved is not None:
            self.check(saved, path)


@dataclass
class _Entry:
    name: str
    obj: Stateful
    where: Where


class StateRegistry:
    """See the module docstring. Every method is collective over the training ranks."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.models: dict[str, tuple[Any, Any]] = {}  # name -> (module, ModelOptimizer)
        self.files: dict[str, CheckpointFiles] = {}

    def _claim(self, name: str) -> None:
        taken = {e.name for e in self.entries} | set(self.files)
        taken |= set(self.models) | {f"{n}_optim" for n in self.models}
        if name in taken or name in ("global_step", "layout", "shared"):
            raise ValueError(f"checkpoint state {name!r} is registered twice")

    def register(self, name: str, obj: Stateful, where: Where = TRAINER) -> None:
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"checkpoint state {name!r}: {type(obj).__name__} has no state_dict/load_state_dict"
            )
        self._claim(name)
        self.entries.append(_Entry(name, obj, where))

    def register_model(self, name: str, model: Any, optim: Any) -> None:
        self._claim(name)
        self.models[name] = (model, optim)

    def register_files(self, name: str, obj: CheckpointFiles) -> None:
        if name in self.files:
            raise ValueError(f"checkpoint files {name!r} are registered twice")
        self.files[name] = obj

    def names(self) -> list[str]:
        return [e.name for e in self.entries] + list(self.models) + [f"{n}/ files" for n in self.files]

    def _where(self, where: Where) -> list[_Entry]:
        return [e for e in self.entries if e.where == where]

    def save(self, ckpt, step: int, extra: dict[str, Any] | None = None) -> str:
        """Write every registered piece into checkpoint ``step`` (``extra``: more trainer_state.json keys,
        e.g. the step's metrics row); returns the published directory."""
        models = {n: m for n, (m, _) in self.models.items()}
        optims = {n: o for n, (_, o) in self.models.items()}
        shards = {f"{n}_optim": o.counters() for n, o in optims.items()}
        shards.update({e.name: e.obj.state_dict() for e in self._where(SHARD)})
        state = {e.name: e.obj.state_dict() for e in self._where(TRAINER)}
        state.update(extra or {})
        shared = {e.name: s for e in self._where(SHARED) if (s := e.obj.state_dict()) is not None}
        files = list(self.files.values())

        def before_publish(partial: str) -> None:
            for f in files:
                f.save_files(partial)

        return ckpt.save(
            step,
            models,
            optims,
            shards,
            state,
            shared or None,
            before_publish=before_publish if files else None,
        )

    def resume(self, ckpt, t: TrainerConfig, rank: int) -> tuple[int, dict[str, float] | None]:
        """Restore the checkpoint trainer.resume_mode names: ``auto`` the tracker's (an unusable tracker
        stops the run in one line, never a silent step 0), ``resume_path`` trainer.resume_from_path,
        ``disable`` none. Returns (the step to continue after, 0 for none; the resumed step's metrics
        row, for ``MetricsLogger.replay``, or None). ``ckpt`` is told the path, so that pruning never
        deletes it."""
        if t.resume_mode == "disable":
            earlier = ckpt.latest()  # a fresh run in a used directory: say what becomes of the old
            if earlier is not None and rank == 0:
                log.info(
                    "trainer.resume_mode=disable: training from step 0 in %s, which holds an earlier run "
                    "(newest %s); its metrics and config are set aside (metrics.1.jsonl, config.1.yaml, "
                    "...), its checkpoints count with this run's for trainer.max_ckpt_to_keep (oldest "
                    "saved first pruned). "
                    "trainer.resume_mode=auto would resume it.",
                    t.default_local_dir,
                    os.path.basename(earlier),
                )
            return 0, None
        path = t.resume_from_path if t.resume_mode == "resume_path" else ckpt.resume_path()
        if path is None:
            return 0, None
        state = self.load(ckpt, path)
        # The row is replayed only into the run directory that wrote the checkpoint (its metrics file
        # may lack it); a run resumed from another directory's checkpoint starts its record after it.
        own = os.path.dirname(os.path.abspath(path)) == os.path.abspath(t.default_local_dir)
        ckpt.resumed_from = path
        if rank == 0:
            log.info("resumed from %s at step %d", path, state["global_step"])
        return state["global_step"], state.get("metrics_row") if own else None

    def load(self, ckpt, path: str) -> dict[str, Any]:
        """Restore every registered piece from checkpoint ``path``; returns its trainer_state.json (with
        global_step and any ``extra`` keys saved)."""
        state_file = os.path.join(path, "trainer_state.json")
        if os.path.isfile(state_file):  # cheap checks first (CheckpointManager.load reports a missing file)
            verify_digests(path)  # every file against the checksums written at save, before any is read
            with open(state_file) as f:
                early = json.load(f)
            for e in self._where(TRAINER):
                if isinstance(e.obj, Value):
                    e.obj.verify(early.get(e.name), path)
        models = {n: m for n, (m, _) in self.models.items()}
        optims = {n: o for n, (_, o) in self.models.items()}
        shards, state = ckpt.load(path, models, optims)
        for n, o in optims.items():
            o.load_counters(shards[f"{n}_optim"])
        for e in self._where(SHARD):
            if e.name not in shards:
                raise CheckpointError(
                    f"{path} holds no {e.name} state: resume with the same algorithm (critic.enable)."
                )
            e.obj.load_state_dict(shards[e.name])
        for e in self._where(TRAINER):
            if not isinstance(e.obj, Value):
                e.obj.load_state_dict(state[e.name])
        for e in self._where(SHARED):
            e.obj.load_state_dict(state.get("shared", {}).get(e.name))
        for files in self.files.values():
            files.load_files(path)
        return state
