"""The separate rollout: the engines run on their own ranks (``roles.remote_rollout``) and work through the
requests in the order posted. After step k the actor's weights (version k) are streamed, then step
k+1+s is asked for (s = rollout.max_staleness): with s=1 the engines generate step k+1 while step k
trains, and every sample of step k was drawn from version k-1-s (fewer at the start: version 0 is the
first). The policy version is recorded with each step when the step is asked for (the engines serve
requests in the order posted, so a request sees exactly the weights streamed before it) and kept in
the queue (roles.rollout.queue) until the step is trained on.

Multi-turn episodes (multi_turn.enable) run on the rollout ranks: each request carries the prompts'
data rows and the multi-turn config, the rollout ranks' agent loop runs the episodes against their
engine (tools there too), and the generations come back with their masks and info; the episodes of
training steps add to multi_turn/* here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from megatron_rl.config import RolloutConfig
from megatron_rl.config.specs import RolloutSpec
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.rollout.queue import RequestQueue
from megatron_rl.roles.rollout.role import Request, RolloutData
from megatron_rl.rollout import Generation, SamplingParams, engine_dtype
from megatron_rl.run.metrics import Timer


class SeparateRollout(RequestQueue):
    """Engines on ranks of their own, up to ``rollout.max_staleness`` steps ahead of training."""

    def __init__(
        self,
        rollout: RolloutConfig,
        spec: RolloutSpec,
        tokenizer_path: str | None,
        ps: ParallelState,
        data: RolloutData,
        actor: torch.nn.Module,
        placement,
        draw: Callable[[], list[int]],
        total_steps: int,
    ):
        """``rollout``: actor_rollout_ref.rollout; ``spec``: the facts it reads beyond it (config.specs);
        ``tokenizer_path``: data.tokenizer (the rollout ranks' agent loop encodes with it);
        ``placement``: the job's config.placement.Placement (the rollout ranks and engines)."""
        from megatron_rl.roles.remote_rollout import RolloutClient

        super().__init__()
        self.rollout, self.spec = rollout, spec
        self.ps, self.data, self.actor, self.draw = ps, data, actor, draw
        self.total_steps, self.staleness = total_steps, rollout.max_staleness
        self.client = RolloutClient(ps, placement, rollout.engine_ranks, spec.dist_timeout_minutes)
        self.pushed = 0  # the weights the engines hold once they reach the next request
        self.trained = 0  # the actor's version
        self._val = 0
        mt = rollout.multi_turn
        self.episodes = {"multi_turn": mt, "tokenizer": tokenizer_path} if mt.enable else None
        self.stats = None
        if mt.enable:
            from megatron_rl.rollout.agent.episode_stats import EpisodeStats

            self.stats = EpisodeStats()

    def _push(self, step: int) -> None:
        dtype = engine_dtype(self.rollout.dtype, self.ps)
        self.client.push_weights(self.actor, self.rollout.update_weights_bucket_megabytes, dtype)
        self.pushed = step

    def _ask(self, step: int) -> None:
        # Up to `staleness` steps past the last are asked for too: the run's final checkpoint then holds
        # the queue a longer run would have had, so resuming it to more steps repeats that run exactly.
        if step > self.total_steps + self.staleness or step in self.asked:
            return
        indices = self.draw()
        self.asked[step] = (indices, self.pushed)  # served after every weights request posted so far
        items = [self.data.train[i] for i in indices]
        self._request(str(Request("train", step)), items, self.sampling(step, validate=False))

    def _request(self, tag: str, items: list, params: SamplingParams) -> None:
        rows = None
        if self.episodes is not None:
            from megatron_rl.roles.remote_rollout import episode_row

            rows = [episode_row(it) for it in items]
        self.client.request(tag, [it.prompt_ids for it in items], params, rows, self.episodes)

    def start(self, step: int) -> None:
        self.trained = step
        self._push(step)
        for k in range(step + 1, step + 2 + self.staleness):
            self._ask(k)

    def prompts(self, step: int) -> list[int]:
        self._ask(step)  # only at a resume whose queue did not reach this step
        return self.asked[step][0]

    def generate(
        self,
        request: Request,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        timer: Timer,
        items: list | None = None,
    ) -> tuple[list[list[Generation]], int]:
        with timer("gen"):  # with staleness > 0 mostly done: the engines ran while the last step trained
            if request.trains:
                if request.step not in self.ready:
                    self.ready[request.step] = self.client.receive(str(request), len(prompt_ids))
                queued = self._queued(request)
                if queued is None:
                    raise RuntimeError(f"{request} was never asked for (SeparateRollout.prompts asks)")
                if self.stats is not None:
                    self.stats.add(queued[0])
                return queued
            if self.pushed != self.trained:  # validation after the last step: its weights
                self._push(self.trained)
            self._val += 1
            key = str(replace(request, seq=self._val))
            if self.episodes is not None and items is None:
                raise ValueError(f"{request}: multi-turn episodes need the prompts' data rows (items)")
            if self.episodes is not None:
                assert items is not None
                self._request(key, items, params)
            else:
                self.client.request(key, prompt_ids, params)
            out = self.client.receive(key, len(prompt_ids))
            self.client.engine_seconds.pop(key, None)
            return out, self.pushed

    def policy_updated(self, step: int, timer: Timer) -> None:
        """After step ``step``'s update: stream version ``step``, ask for step + 1 + staleness."""
        self.trained = step
        if step >= self.total_steps:
            return
        with timer("reshard"):  # waits for the generation in progress (the engines load between requests)
            self._push(step)
            self._ask(step + 1 + self.staleness)

    def step_metrics(self, step: int) -> dict[str, float]:
        """perf/rollout_engine_busy_s: seconds the engines spent generating this step's samples (absent for
        generations from a resumed queue). With the step time it gives the rollout GPUs' idle share.
        Multi-turn: multi_turn/* of the step's episodes."""
        busy = self.client.engine_seconds.pop(str(Request("train", step)), None)
        out = {} if busy is None else {"perf/rollout_engine_busy_s": busy}
        if self.stats is not None:  # collective over the DP ranks
            out.update(self.stats.pop(self.ps))
        return out

    def _take_all(self) -> None:
        for step in sorted(self.asked):
            if step not in self.ready:
                self.ready[step] = self.client.receive(str(Request("train", step)), len(self.asked[step][0]))

    def shutdown(self) -> None:
        """Stop the engines; after the last step, first take the generations still owed (the steps asked
        past it: the engines finish their sends before they stop)."""
        if self.trained >= self.total_steps:
            self.client.drain()
        self.client.stop()
