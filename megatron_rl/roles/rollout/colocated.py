"""The colocated rollout (the hybrid engine): every training rank holds an engine that takes the GPU only
while it generates (``*.megatron.*_offload`` park the training state meanwhile); weights are synced
right before generating, so step k samples with the weights after step k-1 (staleness 0; partial
rollouts carry episodes across steps, within rollout.max_staleness).

    generate(request)   park -> engine memory back -> sync the weights if stale -> the generator
                        (roles.rollout.generators: the engine, or multi-turn episodes) -> engine memory
                        released -> the training state reloaded; a dead engine restarted in place
                        (roles.rollout.supervisor)
    batch(step, ...)    with rollout.partial_rollout: the same cycle around one step of the episodes
                        kept in flight (roles.rollout.partial's window of prompts; the batch is the
                        groups that ended first)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import RolloutConfig
from megatron_rl.config.specs import RolloutSpec
from megatron_rl.offload import HostParking
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.rollout.generators import Generator
from megatron_rl.roles.rollout.partial import PromptWindow, batch_of, share_of, window_state
from megatron_rl.roles.rollout.queue import RequestQueue
from megatron_rl.roles.rollout.role import Request, RolloutData
from megatron_rl.roles.rollout.supervisor import EngineSupervisor
from megatron_rl.rollout import Generation, SamplingParams, engine_dtype
from megatron_rl.rollout.base import EngineFailure
from megatron_rl.rollout.reshard import WeightSyncError
from megatron_rl.run.memory_plan import OffloadPlan
from megatron_rl.run.metrics import Timer
from megatron_rl.run.state import SHARED, StateRegistry

T = TypeVar("T")


class ColocatedRollout(RequestQueue):
    """The engine inside the training processes (the hybrid engine)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        spec: RolloutSpec,
        ps: ParallelState,
        data: RolloutData,
        actor: torch.nn.Module,
        park: Callable[[HostParking], None],
        engine,
        draw: Callable[[], list[int]],
        generator: Generator,
        plan: OffloadPlan,
        new_engine: Callable[[], object] | None = None,
    ):
        """``rollout``: actor_rollout_ref.rollout; ``spec``: the facts it reads beyond it (config.specs);
        ``park(parking)``: park the training state ``plan`` names before generating
        (roles.models.park_for_generation); ``actor``: the module whose weights the engine syncs;
        ``generator``: the engine alone or multi-turn episodes (roles.rollout.generators.make_generator);
        ``plan``: run.memory_plan.OffloadPlan; ``new_engine()``: a fresh engine (collective;
        start_engine) for a restart in place (None: no restarts)."""
        super().__init__()
        self.rollout, self.spec, self.plan = rollout, spec, plan
        self.ps, self.data, self.actor, self.park = ps, data, actor, park
        self.draw = draw
        self.parking = HostParking(ps.device)
        self.trained = 0  # the actor's version, which the engine samples with once synced
        self.weights_stale = True  # the engine starts without the actor's weights
        self.supervisor = EngineSupervisor(
            ps, engine, new_engine, rollout.engine_restarts, self.parking.reload, self._engine_replaced
        )
        self.generator = generator
        self.window = PromptWindow(spec.partial_slots) if spec.partial_slots else None
        """Partial rollouts: this rank's prompts in flight (roles.rollout.partial)."""

    @property
    def engine(self) -> Any:
        """The engine serving this rank now (a restart replaces it)."""
        return self.supervisor.engine

    @property
    def engine_restarts(self) -> int:
        """Restarts over the run (rollout/engine_restarts)."""
        return self.supervisor.restarts

    @property
    def agent_loop(self) -> Any:
        """The built-in agent loop, which partial rollouts run (config.checks)."""
        loop = getattr(self.generator, "runner", None)
        assert loop is not None, "partial rollouts run the built-in agent loop"
        return loop

    def _engine_replaced(self) -> None:
        self.weights_stale = True  # the weights stream into the new engine on the next attempt

    def start(self, step: int) -> None:
        self.trained, self.weights_stale = step, True

    def prompts(self, step: int) -> list[int]:
        if step in self.asked:  # queued by a separate rollout
            return self.asked[step][0]
        if self.window is None:
            return self.draw()
        return [i for _ in range(self.window.draws(self.spec.partial_quota)) for i in self.draw()]

    def batch(
        self, step: int, prompt_indices: list[int], timer: Timer, validate: bool = False
    ) -> RolloutBatch:
        """Partial rollouts (training only): ``prompt_indices`` join the window and the batch is the
        groups the host hands back (roles.rollout.partial); otherwise RequestQueue.batch."""
        if self.window is None or validate:
            return super().batch(step, prompt_indices, timer, validate)
        from megatron_rl.rollout.agent.partial import run_window

        window, loop = self.window, self.agent_loop
        with timer("data"):
            window.fill(prompt_indices)
            new = window.to_send(self.data.train)
        params = self.sampling(step, False)
        quota = self.spec.partial_quota  # train_batch_size / DP
        request = Request("train", step)

        def produce(engine: Any) -> Any:
            return run_window(loop, engine, new, quota, params, self.trained, self.rollout.max_staleness)

        try:
            taken = self._hybrid(request, produce, timer)
        except WeightSyncError as e:  # the weights synced for this step's rollout: name the step
            e.args = (f"step {step}: {e}",)
            raise
        self.generator.record(request, [t[2] for t in taken])
        window.trained([t[0] for t in taken])
        with timer("batch"):
            return batch_of(taken, self.data.pad_id, self.spec.max_new_tokens, step).to(self.ps.device)

    def generate(
        self,
        request: Request,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        timer: Timer,
        items: list | None = None,
    ) -> tuple[list[list[Generation]], int]:
        """``items``: the prompts' data.PromptItem rows (a multi-turn episode reads its tools_kwargs,
        interaction_kwargs and chat messages from them). An engine that died is restarted in place up
        to rollout.engine_restarts times per request (roles.rollout.supervisor); any other error
        propagates."""
        queued = self._queued(request)
        if queued is not None:
            return queued

        def produce(engine: Any) -> list[list[Generation]]:
            gens = self.generator.run(engine, prompt_ids, params, items)
            self.generator.record(request, gens)
            return gens

        return self._hybrid(request, produce, timer), self.trained

    def _hybrid(self, request: Request, produce: Callable[[Any], T], timer: Timer) -> T:
        """``produce(engine)`` inside the hybrid engine's cycle (module docstring), restarted in place
        when the engine dies."""
        out = self.supervisor.run(request, lambda: self._generate_once(produce, timer), timer)
        if self.rollout.free_cache_engine:
            with timer("engine"):
                # SGLang drops its weights with its memory: the next rollout streams them again.
                self.engine.release_memory()
            self.weights_stale = True
        with timer("offload"):
            self.parking.reload()
        return out

    def _generate_once(
        self, produce: Callable[[Any], T], timer: Timer
    ) -> tuple[T | None, EngineFailure | None]:
        """Park, resume the engine, sync the weights if stale, generate: (what ``produce`` returned,
        None), or (None, the failure) when the generator failed (rollout.base.EngineFailure; anything
        else, out of memory and a failed sync check included, is raised: a restart would not cure it)."""
        from megatron_rl.rollout.reshard import sync_weights

        ps, rollout = self.ps, self.rollout
        with timer("offload"):
            self.park(self.parking)
        if rollout.free_cache_engine:
            with timer("engine"):  # the engine's memory comes back (and training's cache goes)
                if ps.device.type == "cuda":
                    torch.cuda.empty_cache()  # training's cached blocks go back to the device
                self.engine.resume_memory()
        if self.weights_stale:
            with timer("reshard"):
                bucket_mb, dtype = rollout.update_weights_bucket_megabytes, engine_dtype(rollout.dtype, ps)
                synced = sync_weights(self.actor, ps, self.engine, bucket_mb, dtype)
            timer.add("reshard_check", synced["check_seconds"])  # the integrity check's share of it
            self.weights_stale = False
        if self.plan.parks("actor", "params"):
            with timer("offload"):
                self.parking.park(self.actor.parameters())
        with timer("gen"):
            try:
                return produce(self.engine), None
            except EngineFailure as e:  # raised on every rank the failed generator serves
                return None, e

    def register_state(self, registry: StateRegistry) -> None:
        super().register_state(registry)
        if self.window is not None:
            registry.register("partial_rollouts", _WindowState(self), SHARED)

    def policy_updated(self, step: int, timer: Timer) -> None:
        self.trained, self.weights_stale = step, True

    def step_metrics(self, step: int) -> dict[str, float]:
        """perf/parked_gb and perf/offload/* (run.memory_plan); multi_turn/*: the episodes of this step's
        training rollouts (rollout/agent/agent_loop.EpisodeStats)."""
        out = self.plan.metrics(self.parking.last_parked_bytes)
        if self.engine_restarts:
            out["rollout/engine_restarts"] = float(self.engine_restarts)
        return {**out, **self.generator.metrics(self.ps)}

    def shutdown(self) -> None:
        self.generator.shutdown()
        self.engine.shutdown()


class _WindowState:
    """The window in a checkpoint (roles.rollout.partial: the rule at a save)."""

    def __init__(self, role: ColocatedRollout) -> None:
        self.role = role

    def state_dict(self) -> dict:
        """Collective over the DP group: every rank's slots; the host drops its groups (tools released)
        and every prompt is sent again at the next step."""
        from megatron_rl.rollout.agent.partial import release

        role = self.role
        window, loop = role.window, role.agent_loop
        assert window is not None  # registered with partial rollouts only
        loop.window.clear(lambda e: release(loop, e))
        window.resend_all()
        parts: list = [None] * role.ps.dp_size
        dist.all_gather_object(parts, window.state(), group=role.ps.dp_group)
        return window_state(parts, window.size)

    def load_state_dict(self, state: dict | None) -> None:
        role = self.role
        assert role.window is not None
        if state is not None:
            role.window.load(share_of(state, role.ps.dp_rank, role.ps.dp_size, role.window.size))
