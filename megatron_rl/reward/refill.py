"""A step's scored batch, and DAPO's refill of it (algorithm.filter_groups).

    scored_batch(generate, prompts, more, reward_fn, ps, cfg, pad_id, timer, metrics)
        generate(prompt_indices) -> RolloutBatch        the rollout role's batch for those prompts
        -> rewards (reward_scores, place_scores)        timing_s/reward
        -> without filter_groups: that batch
        -> with it: drop the groups whose samples all score the same (algos.dapo.informative_groups),
           generate for ``more()`` prompts and keep going until this rank has its share
           (prompts x rollout.n rows); every rank runs the same number of rounds (generation is
           collective), at most filter_groups.max_num_gen_batches
        -> reward/* metrics (and train/num_gen_batches, num_dropped_groups, dropped_group_ratio)

The loop takes a callable rather than the rollout role, so it stays below the roles layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config, ConfigError
from megatron_rl.parallel import ParallelState
from megatron_rl.reward import scoring
from megatron_rl.reward.source import RewardSource


def scored_batch(
    generate: Callable[[list[int]], RolloutBatch],
    prompt_indices: list[int],
    more: Callable[[], list[int]] | None,
    reward_fn: RewardSource,
    ps: ParallelState,
    cfg: Config,
    pad_id: int,
    timer,
    metrics: dict[str, float],
) -> RolloutBatch:
    """Rollout and rewards of this rank's prompts, refilled under algorithm.filter_groups (module
    docstring); adds the reward metrics to ``metrics``."""
    from megatron_rl.algos.dapo import informative_groups

    fg = cfg.algorithm.filter_groups
    quota = len(prompt_indices) * cfg.actor_rollout_ref.rollout.n
    kept: list[RolloutBatch] = []
    have = rounds = errors = 0
    groups = [0, 0]  # [dropped, seen] on this rank
    while True:
        rounds += 1
        batch = generate(prompt_indices)
        with timer("reward"):
            scores, n_err = scoring.reward_scores(reward_fn, batch, ps, cfg)
            scoring.place_scores(batch, scores)
        errors += n_err
        if not fg.enable:
            kept.append(batch)
            break
        uids = [mt.uid for mt in batch.meta]
        informative = informative_groups(scoring.filter_values(batch, fg.metric), uids)
        rows = [i for i, ok in enumerate(informative) if ok]
        groups[0] += len(set(uids)) - len({uids[i] for i in rows})
        groups[1] += len(set(uids))
        rows = rows[: quota - have]
        if rows:
            kept.append(batch.select(rows))
            have += len(rows)
        short = torch.tensor([float(have < quota)], device=ps.device)
        dist.all_reduce(short, op=dist.ReduceOp.MAX)
        if short.item() == 0:
            break
        if 0 < fg.max_num_gen_batches <= rounds:
            raise ConfigError(
                f"algorithm.filter_groups: {rounds} generation rounds (max_num_gen_batches) left "
                f"{have} of {quota} sequences on rank {ps.rank} after dropping groups whose "
                f"{fg.metric or 'acc'} is the same for every sample: raise "
                "algorithm.filter_groups.max_num_gen_batches (0 = no limit) or use easier prompts."
            )
        if more is None:
            raise ValueError(
                "algorithm.filter_groups needs more prompts: pass more= (the sampler's next batch)"
            )
        prompt_indices = more()
    batch = kept[0] if len(kept) == 1 else RolloutBatch.concat(kept, pad_id)
    with timer("metrics"):
        metrics.update(scoring.reward_metrics(batch, errors, ps))
    if fg.enable:
        t = torch.tensor(groups, dtype=torch.float64, device=ps.device)
        dist.all_reduce(t, group=ps.dp_group)
        metrics["train/num_gen_batches"] = float(rounds)
        metrics["train/num_dropped_groups"] = t[0].item()
        metrics["train/dropped_group_ratio"] = (t[0] / t[1].clamp(min=1)).item()
    return batch
