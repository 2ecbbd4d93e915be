"""The request queue, the rollout role's shared face: the steps whose prompts were drawn before the
step ran (``asked``: this rank's prompt indices and the policy version they are generated with; once
taken, ``ready``: the generations), the step's sampling parameters, the batch's assembly and the
staleness metrics. Both placements build on it (roles.rollout.colocated, roles.rollout.separate).

A checkpoint keeps the queue under ``rollout_queue`` (shared by every rank), keyed by step:
``{step: {"prompts": [...], "gens": [...], "version": v}}`` with every DP rank's prompts, so a resume
-- in either placement, at another DP size -- trains on exactly the prompts and samples the sampler
moved past.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import RolloutConfig
from megatron_rl.config.specs import RolloutSpec
from megatron_rl.data import regroup_samples
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.rollout.role import Request, RolloutData, sampling_params
from megatron_rl.roles.transport import gens_from_wire, gens_to_wire
from megatron_rl.rollout import Generation, SamplingParams
from megatron_rl.rollout.reshard import WeightSyncError
from megatron_rl.run.metrics import Timer
from megatron_rl.run.state import SHARED, StateRegistry


class RequestQueue:
    """The queue and the role's shared face (the module docstring); a placement implements
    :meth:`generate` (and :meth:`_take_all` when its generations arrive later)."""

    rollout: RolloutConfig
    """actor_rollout_ref.rollout."""
    spec: RolloutSpec
    """The facts the rollout reads beyond its section (config.specs)."""
    ps: ParallelState
    data: RolloutData
    trained: int
    """The actor's version: the last step whose update is done."""

    def __init__(self) -> None:
        self.asked: dict[int, tuple[list[int], int]] = {}
        self.ready: dict[int, list[list[Generation]]] = {}

    def generate(
        self,
        request: Request,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        timer: Timer,
        items: list | None = None,
    ) -> tuple[list[list[Generation]], int]:
        raise NotImplementedError

    def sampling(self, step: int, validate: bool) -> SamplingParams:
        keep = self.data.keep_log_probs
        return sampling_params(self.rollout, self.spec, self.data.stop_ids, step, validate, keep)

    def batch(
        self, step: int, prompt_indices: list[int], timer: Timer, validate: bool = False
    ) -> RolloutBatch:
        """Generate responses for this rank's prompts and assemble the batch (n samples per prompt),
        every row's meta.policy_version the version that sampled it."""
        ps = self.ps
        data = self.data.val if validate else self.data.train
        if data is None:
            raise ValueError("validation needs data.val_files")
        with timer("data"):
            items = [data[i] for i in prompt_indices]
        request = Request("val" if validate else "train", step)
        params = self.sampling(step, validate)
        try:
            gens, version = self.generate(request, [it.prompt_ids for it in items], params, timer, items)
        except WeightSyncError as e:  # the weights synced for this step's rollout: name the step
            e.args = (f"step {step}: {e}",)
            raise
        with timer("batch"):
            batch = RolloutBatch.from_generations(
                items, gens, self.data.pad_id, self.spec.max_new_tokens, f"{step}-"
            )
            for m in batch.meta:
                m.policy_version = version
            return batch.to(ps.device)

    def staleness_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """rollout/staleness/{mean,max}: policy versions between the weights that sampled each sequence (its
        oldest model token) and the actor it trains (the role's trained version); 0 in the synchronous
        loop. rollout/staleness/token_mean: the same over the model's tokens, each by its own version
        (partial rollouts: a carried episode's later turns are fresher than its first)."""
        ps = self.ps
        lag = self.trained - torch.tensor([float(m.policy_version) for m in batch.meta], dtype=torch.float64)
        mask = batch.response_mask.detach().to("cpu", torch.float64)  # [B, T]
        tok_lag = lag[:, None].expand_as(mask).clone()  # [B, T]: each token by its row's version
        for i, m in enumerate(batch.meta):
            if m.token_versions:  # partial rollouts: each token by the version that sampled it
                v = torch.tensor(m.token_versions[: mask.shape[1]], dtype=torch.float64)
                tok_lag[i, : v.numel()] = self.trained - v
        count = torch.tensor(float(lag.numel()), dtype=torch.float64)
        t = torch.stack([lag.sum(), count, (tok_lag * mask).sum(), mask.sum()]).to(ps.device)
        top = lag.max().reshape(1).to(ps.device)
        dist.all_reduce(t, group=ps.dp_group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.dp_group)
        return {
            "rollout/staleness/mean": (t[0] / t[1].clamp(min=1)).item(),
            "rollout/staleness/max": top.item(),
            "rollout/staleness/token_mean": (t[2] / t[3].clamp(min=1)).item(),
        }

    def register_state(self, registry: StateRegistry) -> None:
        registry.register("rollout_queue", self, SHARED)

    def state_dict(self) -> dict | None:
        return self.queue_state()

    def load_state_dict(self, state: dict | None) -> None:
        self.load_queue(state)

    def _take_all(self) -> None:
        """Make every asked step ready (nothing to wait for when colocated)."""

    def queue_state(self) -> dict | None:
        """Collective: every step asked for and not trained on, in DP order (the same on every rank):
        {step: {"prompts": [...], "gens": [...], "version": v}} with the prompts of every DP rank."""
        self._take_all()
        if not self.asked:
            return None
        mine = {
            k: (self.asked[k][0], gens_to_wire(self.ready[k]), self.asked[k][1]) for k in sorted(self.asked)
        }
        parts: list = [None] * self.ps.dp_size
        dist.all_gather_object(parts, mine, group=self.ps.dp_group)
        gather = {"prompts": 0, "gens": 1}  # every DP rank's, in DP order
        return {
            k: {**{f: [x for p in parts for x in p[k][j]] for f, j in gather.items()}, "version": mine[k][2]}
            for k in mine
        }

    def load_queue(self, state: dict | None) -> None:
        """This DP rank's share of a saved queue (DP size and samples per prompt may have changed)."""
        ps, per_draw = self.ps, self.spec.samples_per_draw
        for k, q in (state or {}).items():
            prompts, gens = regroup_samples(q["prompts"], q["gens"], per_draw)
            per = len(prompts) // ps.dp_size
            lo, hi = ps.dp_rank * per, (ps.dp_rank + 1) * per
            self.asked[int(k)] = (prompts[lo:hi], int(q["version"]))
            self.ready[int(k)] = gens_from_wire(gens[lo:hi])

    def step_metrics(self, step: int) -> dict[str, float]:
        """Metrics of the role for step ``step`` (the separate rollout's engine time)."""
        return {}

    def _queued(self, request: Request) -> tuple[list[list[Generation]], int] | None:
        """A training step's generations and their version if ready (the step leaves the queue anyway)."""
        if not request.trains:
            return None
        step = request.step
        asked = self.asked.pop(step, None)
        gens = self.ready.pop(step, None)
        return None if gens is None or asked is None else (gens, asked[1])
