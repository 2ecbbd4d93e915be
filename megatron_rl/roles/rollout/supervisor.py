"""The colocated rollout engine: started (:func:`start_engine`) and kept alive (:class:`EngineSupervisor`).

An engine that died (its worker or the connection to it gone: rollout.base.EngineDied, raised as
EngineFailure on every rank it serves) is restarted in place, every rank's engine at once, up to
``actor_rollout_ref.rollout.engine_restarts`` times per request; the weights then stream into the new
engine and the request runs again. Any other error propagates with its own message: a restart would
not cure it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.rollout.role import Request
from megatron_rl.rollout.base import EngineFailure
from megatron_rl.run.metrics import Timer

T = TypeVar("T")


def start_engine(cfg: Config, ps: ParallelState, model_args):
    """The colocated rollout engine (collective), its memory given back until the first rollout."""
    from megatron_rl.config.lora import engine_lora_of
    from megatron_rl.rollout import create_engine
    from megatron_rl.run.memory_plan import cuda_graph_max_bs

    rollout = cfg.actor_rollout_ref.rollout  # SGLang without a GPU: rollout.check_engine_device
    t0 = time.perf_counter()
    # SGLang captures decode graphs up to the rows one engine (or attention group) decodes at once
    graph_bs = cuda_graph_max_bs(cfg, ps.world_size // rollout.tensor_model_parallel_size)
    path = cfg.actor_rollout_ref.model.path
    r3 = cfg.actor_rollout_ref.actor.router_replay.mode == "R3"
    lora = engine_lora_of(cfg)  # the actor's adapters unmerged (lora.merge=false): SGLang's LoRA on
    engine = create_engine(
        rollout, path, model_args, ps, rollout.seed, graph_bs, routed_experts=r3, lora=lora
    )
    if ps.rank == 0:
        sglang_graphs = rollout.enable_cuda_graph and rollout.name == "sglang"
        graphs = f"on, up to batch {graph_bs}" if sglang_graphs else "off"
        print(
            f"megatron-rl: rollout engine {rollout.name} ({rollout.engine_layout}, "
            f"CUDA graphs {graphs}) started in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    if rollout.free_cache_engine:
        engine.release_memory()
    return engine


class EngineSupervisor:
    """The one home of the colocated engine (``engine``) and of its restarts (``restarts``, over the run:
    rollout/engine_restarts)."""

    def __init__(
        self,
        ps: ParallelState,
        engine: Any,
        new_engine: Callable[[], Any] | None,
        allowed: int,
        before_restart: Callable[[], None],
        after_restart: Callable[[], None],
    ) -> None:
        """``new_engine()``: a fresh engine (collective; :func:`start_engine`), None: no restarts;
        ``allowed``: restarts per request; ``before_restart()`` runs before the old engine shuts down
        (the actor's parameters back on the device), ``after_restart()`` once the new one is up (its
        weights are stale)."""
        self.ps, self.engine, self.new_engine = ps, engine, new_engine
        self.allowed = allowed if new_engine is not None else 0
        self.before_restart, self.after_restart = before_restart, after_restart
        self.restarts = 0

    def run(
        self, request: Request, attempt: Callable[[], tuple[T | None, EngineFailure | None]], timer: Timer
    ) -> T:
        """``attempt()`` until it succeeds on every training rank: (its result, None), or (None, the
        failure) when the engine failed on this rank; the engine restarted in place between attempts."""
        for n in range(self.allowed + 1):
            out, error = attempt()
            if not self._failed_anywhere(error):
                assert out is not None  # no rank failed
                return out
            if n == self.allowed:
                raise error or RuntimeError(
                    f"{request}: the rollout engine failed on another rank (its log has the cause)"
                )
            self._restart_engine(request, error, n + 1, timer)
        raise AssertionError("unreachable")

    def _failed_anywhere(self, error: EngineFailure | None) -> bool:
        """Whether the engine failed on any training rank (collective over every one of them)."""
        flag = torch.tensor([0.0 if error is None else 1.0], device=self.ps.device)
        for group in (self.ps.mp_group, self.ps.dp_group):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _restart_engine(self, request: Request, error: EngineFailure | None, n: int, timer: Timer) -> None:
        """Every rank's engine shut down and started again (collective: an engine of rollout TP > 1
        spans ranks); the weights stream into it on the next attempt."""
        ps = self.ps
        if error is not None and error.rank == ps.global_rank:  # one line, from the rank that hosts it
            cause = " ".join(error.cause.split())[:300]
            print(
                f"megatron-rl: {request}: the rollout engine on rank {error.rank} failed ({cause}); "
                f"restarting every rank's engine in place ({n} of {self.allowed}: actor_rollout_ref.rollout."
                "engine_restarts), syncing the weights again and generating the step again",
                flush=True,
            )
        with timer("engine"):
            self.before_restart()
            try:
                self.engine.shutdown()
            except Exception:  # a crashed engine may not shut down cleanly; its replacement starts anyway
                pass
            assert self.new_engine is not None
            self.engine = self.new_engine()
        self.after_restart()
        self.restarts += 1
