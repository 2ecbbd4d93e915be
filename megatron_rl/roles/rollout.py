"""The rollout role as the loop sees it: which prompts a step uses, their generations, and the policy
version (the step whose updated weights sampled them) -- whether the engine shares the training ranks
or has ranks of its own (trainer.placement.rollout).

    rollout = make_rollout(...)           ColocatedRollout | SeparateRollout
    rollout.start(step)                   after resume: nothing | stream weights, ask ahead
    prompts = rollout.prompts(step)       the sampler's next batch | the batch asked for earlier
    gens, version = rollout.generate(...) park, sync, generate, reload | wait for the engines
    rollout.policy_updated(step)          mark the engine stale | stream weights, ask for step+1+s
    rollout.queue_state() / load_queue()  nothing | the generations asked for but not yet trained on

Colocated (the hybrid engine): every training rank holds an engine that takes the GPU only while it
generates (``*.megatron.*_offload`` park the training state meanwhile); weights are synced right before
generating, so step k always samples with the weights after step k-1 (staleness 0).

Separate: the engines run on their own ranks (``rollout.remote``) and work through the requests in
the order posted. After step k the actor's weights (version k) are streamed, then step k+1+s is asked
for (s = rollout.max_staleness): with s=1 the engines generate step k+1 while step k trains, and every
sample of step k was drawn from version k-1-s (fewer at the start: version 0 is the first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.offload import HostParking
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.models import Models, park_for_generation
from megatron_rl.roles.transport import from_plain, to_plain
from megatron_rl.rollout import Generation, SamplingParams, engine_dtype


def make_agent(cfg: Config, ps: ParallelState, tokenizer):
    """The multi-turn agent loop and its step statistics, or (None, None) without multi_turn.enable."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None, None
    from megatron_rl.rollout.agent_loop import AgentLoop, EpisodeStats

    if tokenizer is None:
        raise ValueError("actor_rollout_ref.rollout.multi_turn.enable needs ColocatedRollout(tokenizer=...)")
    return AgentLoop(mt, ps, tokenizer), EpisodeStats()


class _Queue:
    """Steps whose prompts were drawn before the step ran: ``asked`` (step -> this rank's prompt
    indices) and, once taken, ``ready`` (step -> generations, version). A checkpoint keeps both, so a
    resume -- in either placement -- trains on exactly the prompts and samples the sampler moved past."""

    ps: ParallelState

    def __init__(self) -> None:
        self.asked: dict[int, list[int]] = {}
        self.ready: dict[int, tuple[list[list[Generation]], int]] = {}

    def _take_all(self) -> None:
        """Make every asked step ready (nothing to wait for when colocated)."""

    def queue_state(self) -> dict | None:
        """Collective: every step asked for and not trained on, in DP order (the same on every rank):
        {step: {"prompts": [...], "gens": [...], "version": v}} with the prompts of every DP rank."""
        self._take_all()
        if not self.asked:
            return None
        mine = {k: (self.asked[k], to_plain(self.ready[k][0]), self.ready[k][1]) for k in sorted(self.asked)}
        parts: list = [None] * self.ps.dp_size
        dist.all_gather_object(parts, mine, group=self.ps.dp_group)
        return {
            k: {
                "prompts": [i for p in parts for i in p[k][0]],
                "gens": [g for p in parts for g in p[k][1]],
                "version": mine[k][2],
            }
            for k in mine
        }

    def load_queue(self, state: dict | None) -> None:
        """This DP rank's share of a saved queue (the DP size may have changed since)."""
        ps = self.ps
        for k, q in (state or {}).items():
            per = len(q["prompts"]) // ps.dp_size
            lo, hi = ps.dp_rank * per, (ps.dp_rank + 1) * per
            self.asked[int(k)] = list(q["prompts"][lo:hi])
            self.ready[int(k)] = (from_plain(q["gens"][lo:hi]), int(q["version"]))

    def step_metrics(self, step: int) -> dict[str, float]:
        """Metrics of the role for step ``step`` (the separate rollout's engine time)."""
        return {}

    def _queued(self, tag: str) -> tuple[list[list[Generation]], int] | None:
        """A training step's generations if they are ready (the step leaves the queue either way)."""
        if not tag.startswith("train/"):
            return None
        step = int(tag.split("/")[1])
        self.asked.pop(step, None)
        return self.ready.pop(step, None)


class ColocatedRollout(_Queue):
    """The engine inside the training processes (the hybrid engine)."""

    def __init__(
        self,
        cfg: Config,
        ps: ParallelState,
        models: Models,
        engine,
        draw: Callable[[], list[int]],
        tokenizer=None,
    ):
        super().__init__()
        self.cfg, self.ps, self.models, self.engine, self.draw = cfg, ps, models, engine, draw
        self.parking = HostParking(ps.device)
        self.version = 0
        self.weights_stale = True  # the engine starts without the actor's weights
        # multi_turn.enable: episodes of turns with tools / a simulated user (rollout/agent_loop.py)
        self.agent, self.episode_stats = make_agent(cfg, ps, tokenizer)

    def start(self, step: int) -> None:
        self.version, self.weights_stale = step, True

    def prompts(self, step: int) -> list[int]:
        return self.asked[step] if step in self.asked else self.draw()  # queued by a separate rollout

    def generate(
        self, tag: str, prompt_ids: list[list[int]], params: SamplingParams, timer, items: list | None = None
    ) -> tuple[list[list[Generation]], int]:
        """``items``: the prompts' data.PromptItem rows (a multi-turn episode reads its tools_kwargs,
        interaction_kwargs and chat messages from them)."""
        from megatron_rl.rollout.reshard import sync_weights

        queued = self._queued(tag)
        if queued is not None:
            return queued
        ps, rollout = self.ps, self.cfg.actor_rollout_ref.rollout
        free = rollout.free_cache_engine
        with timer("offload"):
            park_for_generation(self.models, self.cfg, self.parking)
        if free:
            with timer("engine"):  # the engine's memory comes back (and training's cache goes)
                if ps.device.type == "cuda":
                    torch.cuda.empty_cache()  # training's cached blocks go back to the device
                self.engine.resume_memory()
        if self.weights_stale:
            with timer("reshard"):
                sync_weights(
                    self.models.actor,
                    ps,
                    self.engine,
                    rollout.update_weights_bucket_megabytes,
                    engine_dtype(rollout.dtype, ps),
                )
            self.weights_stale = False
        if self.cfg.actor_rollout_ref.actor.megatron.param_offload:
            with timer("offload"):
                self.parking.park(self.models.actor.parameters())
        if params.seed is not None:
            params = replace(params, seed=params.seed + ps.dp_rank)
        with timer("gen"):
            if self.agent is None:
                gens = self.engine.generate(prompt_ids, params)
            else:
                gens = self.agent.run(self.engine, prompt_ids, params, items)
                if tag.startswith("train/"):
                    self.episode_stats.add(gens)
        if free:
            with timer("engine"):
                # SGLang drops its weights with its memory: the next rollout streams them again.
                self.engine.release_memory()
            self.weights_stale = True
        with timer("offload"):
            self.parking.reload()
        return gens, self.version

    def policy_updated(self, step: int, timer) -> None:
        self.version, self.weights_stale = step, True

    def step_metrics(self, step: int) -> dict[str, float]:
        """multi_turn/*: the episodes of this step's training rollouts (rollout/agent_loop.EpisodeStats)."""
        return {} if self.agent is None else self.episode_stats.pop(self.ps)

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.shutdown()
        self.engine.shutdown()


class SeparateRollout(_Queue):
    """Engines on ranks of their own, up to ``rollout.max_staleness`` steps ahead of training."""

    def __init__(
        self,
        cfg: Config,
        ps: ParallelState,
        models: Models,
        rollout_ranks: int,
        draw: Callable[[], list[int]],
        prompt_ids: Callable[[list[int]], list[list[int]]],
        sampling: Callable[[int], SamplingParams],
        total_steps: int,
    ):
        from megatron_rl.roles.remote_rollout import RolloutClient

        super().__init__()
        rollout = cfg.actor_rollout_ref.rollout
        self.cfg, self.ps, self.models = cfg, ps, models
        self.draw, self.prompt_ids, self.sampling = draw, prompt_ids, sampling
        self.total_steps, self.staleness = total_steps, rollout.max_staleness
        engines = rollout_ranks // rollout.tensor_model_parallel_size
        self.client = RolloutClient(ps, rollout_ranks, engines, cfg.trainer.dist_timeout_minutes)
        self.version = 0  # the weights the engines hold once they reach the next request
        self.trained = 0  # the actor's version
        self._val = 0

    def _push(self, step: int) -> None:
        rollout = self.cfg.actor_rollout_ref.rollout
        dtype = engine_dtype(rollout.dtype, self.ps)
        self.client.push_weights(self.models.actor, rollout.update_weights_bucket_megabytes, dtype)
        self.version = step

    def _ask(self, step: int) -> None:
        # Up to `staleness` steps past the last are asked for too: the run's final checkpoint then holds
        # the queue a longer run would have had, so resuming it to more steps repeats that run exactly.
        if step > self.total_steps + self.staleness or step in self.asked:
            return
        indices = self.draw()
        self.asked[step] = indices
        self.client.request(f"train/{step}", self.prompt_ids(indices), self.sampling(step), self.version)

    def start(self, step: int) -> None:
        self.trained = step
        self._push(step)
        for k in range(step + 1, step + 2 + self.staleness):
            self._ask(k)

    def prompts(self, step: int) -> list[int]:
        self._ask(step)  # only at a resume whose queue did not reach this step
        return self.asked[step]

    def generate(
        self, tag: str, prompt_ids: list[list[int]], params: SamplingParams, timer, items: list | None = None
    ) -> tuple[list[list[Generation]], int]:
        with timer("gen"):  # with staleness > 0 mostly done: the engines ran while the last step trained
            if tag.startswith("train/"):
                queued = self._queued(tag)
                if queued is not None:
                    return queued
            else:
                if self.version != self.trained:  # validation after the last step: its weights
                    self._push(self.trained)
                self._val += 1
                tag = f"{tag}/{self._val}"
                self.client.request(tag, prompt_ids, params, self.version)
                out = self.client.receive(tag, len(prompt_ids))
                self.client.engine_seconds.pop(tag, None)
                return out
            return self.client.receive(tag, len(prompt_ids))

    def policy_updated(self, step: int, timer) -> None:
        """After step ``step``'s update: stream version ``step``, ask for step + 1 + staleness."""
        self.trained = step
        if step >= self.total_steps:
            return
        with timer("reshard"):  # waits for the generation in progress (the engines load between requests)
            self._push(step)
            self._ask(step + 1 + self.staleness)

    def step_metrics(self, step: int) -> dict[str, float]:
        """perf/rollout_engine_busy_s: seconds the engines spent generating this step's samples (absent for
        generations from a resumed queue). With the step time it gives the rollout GPUs' idle share."""
        busy = self.client.engine_seconds.pop(f"train/{step}", None)
        return {} if busy is None else {"perf/rollout_engine_busy_s": busy}

    def _take_all(self) -> None:
        for step in sorted(self.asked):
            if step not in self.ready:
                self.ready[step] = self.client.receive(f"train/{step}", len(self.asked[step]))

    def shutdown(self) -> None:
        self.client.stop()
