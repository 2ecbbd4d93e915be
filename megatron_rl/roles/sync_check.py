"""The engine's log-probs against the actor's on a fixed prompt set (trainer.sync_check_freq).

The weight sync's checksums (``rollout.reshard.check_weights``) prove the engine holds the bytes the
stream sent; this probe proves those bytes are the actor's policy (a layout bug in the stream, an
engine that reads a tensor under another name). Every ``sync_check_freq`` steps, right after the
step's rollout (the engine and the actor then hold the same version):

    the first PROMPTS_PER_RANK prompts of this DP rank's slice of the training set (fixed for the run)
      -> rollout role's generate(greedy, a few tokens, the engine's log-probs) [b, r] engine log-probs
      -> ppo.compute_log_probs(the actor role's model) of the same tokens    [b, r] actor log-probs
      -> mean |difference| over the generated tokens of every DP rank, against the tolerance of the
         rollout's precision (TOLERANCE): above it, WeightSyncError on every rank, in one line.

With LoRA adapters loaded into the engine apart from the base (``lora.merge`` false,
rollout.lora_sync) the probe generates through the adapter like every request and the actor scores with
its adapters on, so it compares base + adapters on both sides: the base's checksums ran at its one
stream, and the adapters have no read-back of their own.

Logged as sync_check/logprob_diff_mean and sync_check/logprob_diff_max. Not with multi-turn rollouts
(actor_rollout_ref.rollout.multi_turn.enable: the probe would be an episode with tool calls); the
checksums of every sync still run there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config
from megatron_rl.config.specs import RolloutSpec
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.rollout.role import RolloutData
from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.reshard import WeightSyncError

PROMPTS_PER_RANK = 4
PROBE_TOKENS = 8

TOLERANCE = {"float32": 1e-3, "fp32": 1e-3, "bfloat16": 0.1, "bf16": 0.1, "float16": 0.05, "fp16": 0.05}
"""Largest mean |engine - actor| log-prob on the probe's greedy tokens, by the engine's dtype (on CPU
the engine runs in float32)."""


class SyncProbe:
    """See the module docstring; ``run`` is collective over the training ranks."""

    def __init__(self, cfg: Config, spec: RolloutSpec, ps: ParallelState, data: RolloutData) -> None:
        """``spec``: the rollout's facts (config.specs.RolloutSpec: the engine's dtype here); ``data``:
        the training prompts, the pad and stop tokens."""
        self.cfg, self.ps, self.pad_id = cfg, ps, data.pad_id
        train_data, stop_ids = data.train, data.stop_ids
        # multi-turn rollouts would run the probe as episodes (tool calls and all): the checksums only
        self.freq = 0 if cfg.actor_rollout_ref.rollout.multi_turn.enable else cfg.trainer.sync_check_freq
        n = len(train_data)
        first = ps.dp_rank * PROMPTS_PER_RANK
        self.items = [train_data[(first + j) % n] for j in range(PROMPTS_PER_RANK)] if n else []
        rollout = cfg.actor_rollout_ref.rollout
        self.dtype, self.tolerance = spec.dtype, TOLERANCE.get(spec.dtype, 0.1)
        self.params = SamplingParams(
            n=1,
            temperature=1.0,
            greedy=True,
            max_new_tokens=max(1, min(PROBE_TOKENS, cfg.data.max_response_length)),
            stop_token_ids=list(stop_ids),
            return_logprobs=True,
            seed=rollout.seed,
        )

    def due(self, step: int) -> bool:
        return self.freq > 0 and bool(self.items) and step % self.freq == 0

    def maybe_run(self, step: int, rollout, actor, timer) -> dict[str, float]:
        """:meth:`run` when step ``step`` is due (timed as timing_s/sync_check), else nothing."""
        if not self.due(step):
            return {}
        with timer("sync_check"):
            return self.run(step, rollout, actor)

    def run(self, step: int, rollout, actor) -> dict[str, float]:
        """Generate the probe with the rollout role, score it with the actor role's model, compare
        (module docstring). The probe's own phases are not added to the step's gen/reshard."""
        from megatron_rl import ppo
        from megatron_rl.roles.rollout import Request
        from megatron_rl.run.metrics import Timer

        ps = self.ps
        prompts = [it.prompt_ids for it in self.items]
        probe = Request("sync_check", step)
        gens, _ = rollout.generate(probe, prompts, self.params, Timer(ps.device), self.items)
        batch = RolloutBatch.from_generations(
            self.items, gens, self.pad_id, self.params.max_new_tokens, "sync-check-"
        ).to(ps.device)
        if batch.rollout_log_probs is None:
            return {}
        actor_lp = ppo.compute_log_probs(actor.model, ps, batch, actor.passes.old_log_prob, 1.0)  # [b, r]
        engine_lp = batch.rollout_log_probs.to(actor_lp.dtype)
        mask = batch.response_mask.bool() & ~engine_lp.isnan()
        diff = (actor_lp - engine_lp).abs().masked_fill(~mask, 0.0)
        # sum, tokens, max over this DP rank's probe; then over every DP rank
        total = torch.stack([diff.sum(), mask.sum().to(diff.dtype)]).to(torch.float64)
        peak = diff.max().reshape(1).to(torch.float64)
        if ps.dp_size > 1:
            dist.all_reduce(total, group=ps.dp_group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.dp_group)
        mean = float(total[0] / total[1].clamp(min=1))
        if mean > self.tolerance:
            raise WeightSyncError(
                f"step {step}: sync check failed: the rollout engine's log-probs differ from the actor's by "
                f"{mean:.3g} on average (max {float(peak):.3g}) over {int(total[1])} greedy tokens of the "
                f"fixed probe prompts, above {self.tolerance:g} for {self.dtype}: the engine generates from "
                "another policy (a weight-stream layout or engine-loading bug; docs/reliability.md, Sync "
                "integrity). trainer.sync_check_freq=0 turns the probe off.",
                same_on_all_ranks=True,
            )
        return {"sync_check/logprob_diff_mean": mean, "sync_check/logprob_diff_max": float(peak)}
