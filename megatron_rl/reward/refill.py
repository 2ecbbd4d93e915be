"""A step's scored batch, and DAPO's refill of it (algorithm.filter_groups).

    scored_batch(generate, prompts, more, reward_fn, ps, cfg, pad_id, timer, metrics)
        generate(prompt_indices) -> RolloutBatch        the rollout role's batch for those prompts
        -> rewards (reward_scores, place_scores)        timing_s/reward
        -> without filter_groups: that batch
        -> with it: drop the groups whose samples all score the same (algos.dapo.informative_groups),
           generate for ``more()`` prompts and keep going until the batch is full; every rank runs the
           same number of rounds (generation is collective), at most filter_groups.max_num_gen_batches
        -> reward/* metrics (and train/num_gen_batches, num_dropped_groups, dropped_group_ratio)

Whole prompts per rank (data.train_batch_size a multiple of the data-parallel size): each rank fills its
own share (prompts x rollout.n rows) with its own groups. Samples per rank (the prompts do not divide,
config.batch_sizes.samples_per_draw == 1): a prompt's samples may lie on several ranks, so each row's uid
names its prompt's place in the round (``<step>-<row>#<round>.<prompt>``: one group however the samples
are spread), the filter decides on the groups of the whole data-parallel batch, and the first
train_batch_size kept groups, in round and prompt order, are dealt out again in equal contiguous slices
(verl's order: its driver keeps whole groups and splits the samples over the ranks).

The loop takes a callable rather than the rollout role, so it stays below the roles layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config, ConfigError
from megatron_rl.config.batch_sizes import samples_per_draw
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

    fg, n = cfg.algorithm.filter_groups, cfg.actor_rollout_ref.rollout.n
    split = samples_per_draw(cfg, ps.dp_size) != n  # a prompt's samples may span ranks
    # rows of this rank (whole prompts), or prompt groups over all ranks (split)
    quota = cfg.data.train_batch_size if split else len(prompt_indices) * n
    kept: list[RolloutBatch] = []
    slots: list[tuple[int, int]] = []  # split: the (round, prompt) groups kept, over every rank
    have = rounds = errors = 0
    groups = [0, 0]  # [dropped, seen]: on this rank (whole prompts) or over all ranks (split)
    while True:
        rounds += 1
        batch = generate(prompt_indices)
        first = ps.dp_rank * len(batch)  # split: this rank's first sample in the round's batch
        if split:
            for i, m in enumerate(batch.meta):
                m.uid = f"{m.uid}#{rounds}.{(first + i) // n}"
        with timer("reward"):
            scores, n_err = scoring.reward_scores(reward_fn, batch, ps, cfg)
            scoring.place_scores(batch, scores)
        errors += n_err
        if not fg.enable:
            kept.append(batch)
            break
        values = scoring.filter_values(batch, fg.metric)
        if split:  # the decision on the groups of the whole data-parallel batch
            everyone = _gather(values, ps)
            informative = informative_groups(everyone, [j // n for j in range(len(everyone))])
            good = [s for s in range(len(everyone) // n) if informative[s * n]]
            groups[0] += len(everyone) // n - len(good)
            groups[1] += len(everyone) // n
            slots += [(rounds, s) for s in good]
            kept.append(batch)
            have = len(slots)
        else:
            uids = [mt.uid for mt in batch.meta]
            informative = informative_groups(values, uids)
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
            left = (
                f"{have} of {quota} prompt groups"
                if split
                else f"{have} of {quota} sequences on rank {ps.rank}"
            )
            raise ConfigError(
                f"algorithm.filter_groups: {rounds} generation rounds (max_num_gen_batches) left "
                f"{left} after dropping groups whose "
                f"{fg.metric or 'acc'} is the same for every sample: raise "
                "algorithm.filter_groups.max_num_gen_batches (0 = no limit) or use easier prompts."
            )
        if more is None:
            raise ValueError(
                "algorithm.filter_groups needs more prompts: pass more= (the sampler's next batch)"
            )
        prompt_indices = more()
    if split and fg.enable:
        batch = _deal(kept, slots[:quota], n, ps, pad_id)
    else:
        batch = kept[0] if len(kept) == 1 else RolloutBatch.concat(kept, pad_id)
    with timer("metrics"):
        metrics.update(scoring.reward_metrics(batch, errors, ps))
    if fg.enable:
        t = torch.tensor(groups, dtype=torch.float64, device=ps.device)
        if not split:
            dist.all_reduce(t, group=ps.dp_group)
        metrics["train/num_gen_batches"] = float(rounds)
        metrics["train/num_dropped_groups"] = t[0].item()
        metrics["train/dropped_group_ratio"] = (t[0] / t[1].clamp(min=1)).item()
    return batch


def _gather(values: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """[k] per rank -> [dp x k] in data-parallel order (every rank holds k rows of a round)."""
    if ps.dp_size == 1:
        return values
    mine = values.to(ps.device)
    parts = [torch.empty_like(mine) for _ in range(ps.dp_size)]
    dist.all_gather(parts, mine, group=ps.dp_group)
    return torch.cat(parts).cpu()


def _deal(
    batches: list[RolloutBatch], slots: list[tuple[int, int]], n: int, ps: ParallelState, pad_id: int
) -> RolloutBatch:
    """This rank's equal contiguous share of the kept groups ``slots`` ((round, prompt) in order, each
    group's n samples), collected from the ranks whose round batches (``batches``, one per round) hold
    them."""
    k = len(batches[0])  # every rank's rows per round
    wanted = [(r, s * n + j) for r, s in slots for j in range(n)]  # (round, sample) in the final order
    share = len(wanted) // ps.dp_size
    mine = wanted[ps.dp_rank * share : (ps.dp_rank + 1) * share]
    lo = ps.dp_rank * k
    # Every rank sends the rows of kept groups it holds (round by round, in order); each takes its share.
    keys = [(r, j) for r, j in wanted if lo <= j < lo + k]
    held = [[j - lo for rr, j in keys if rr == r] for r in range(1, len(batches) + 1)]
    cpu = torch.device("cpu")
    send = [batches[r].select(rows).to(cpu) for r, rows in enumerate(held) if rows]
    parts: list = [(keys, send)]
    if ps.dp_size > 1:
        parts = [None] * ps.dp_size
        dist.all_gather_object(parts, (keys, send), group=ps.dp_group)
    pool = RolloutBatch.concat([b for _, bs in parts for b in bs], pad_id)
    where = {key: i for i, key in enumerate(key for ks, _ in parts for key in ks)}
    return pool.select([where[key] for key in mine]).to(ps.device)
