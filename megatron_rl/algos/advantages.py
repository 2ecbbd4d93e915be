"""Advantage estimators and masked statistics.

Every function takes token-level tensors shaped ``[batch, response_len]`` together with a
``response_mask`` of the same shape (1.0 on real response tokens, 0.0 on padding after EOS) and returns
tensors of that shape. Names and semantics follow verl's ``core_algos`` so that ``algorithm.adv_estimator``
means the same thing in both trainers.

Whitening can be made global across data-parallel ranks by passing a ``torch.distributed`` process group:
the mean and variance are then reduced over the group, so every rank gets exactly the result of
whitening the concatenation of all ranks' data. All ranks of the group must call the function together.

Outcome estimators that compare samples of one prompt (GRPO, RLOO, REINFORCE++-baseline, GPG) group rows
by ``index``. Given a process group they take the groups over every rank's rows, so a prompt's samples
may be spread over data-parallel ranks (verl's rule: the train_batch_size x rollout.n samples, not the
prompts, divide over the ranks); a group whose rows all lie on one rank gets the statistics it gets
alone, and when no group spans ranks nothing but the uids is exchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ADV_ESTIMATORS",
    "compute_gae",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "get_adv_estimator",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]

_EPS = 1e-8


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (reduced over ``dim``, or everything).

    An all-zero mask gives 0, not NaN.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / (mask.sum() + _EPS)
    return (x * mask).sum(dim=dim) / (mask.sum(dim=dim) + _EPS)


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    # Half-precision sums over a whole batch lose too many digits; accumulate in at least float32.
    return torch.promote_types(x.dtype, torch.float32)


def _masked_moments(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, var) of the masked entries of ``x``, over the union of all ranks in ``group``.

    Two passes (mean first, then the centred sum of squares) rather than sum/sum-of-squares in one
    reduction: rewards often have a large mean and small spread, where ``E[x^2] - E[x]^2`` cancels
    catastrophically in float32.
    """
    xs = x.to(_stats_dtype(x))
    m = mask.to(xs.dtype)
    # stats: [masked sum, token count], summed over ranks.
    stats = torch.stack([(xs * m).sum(), m.sum()])
    if group is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    total, count = stats[0], stats[1]
    mean = total / (count + _EPS)
    sq = ((xs - mean) ** 2 * m).sum()
    if group is not None:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    var = sq / (count + _EPS)
    if unbiased:
        n = count.item()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element; at least one has to be 1.")
        if n == 1:
            raise ValueError(
                "masked_var: the mask selects a single element; the unbiased variance is undefined."
            )
        var = var * (n / (n - 1))
    return mean, var


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of ``x`` (Bessel-corrected when ``unbiased``, like ``torch.var``).

    Raises ValueError when ``unbiased`` and the mask selects fewer than two elements.
    """
    return _masked_moments(x, mask, unbiased, group=None)[1].to(x.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, group: ProcessGroup | None = None
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance taken over the masked entries.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised). With ``group``, the
    statistics cover every rank's masked entries (the result equals whitening the concatenation of all
    ranks' data); ranks may hold different shapes and token counts. Positions outside the mask are
    transformed too but carry no meaning.
    """
    mean, var = _masked_moments(x, mask, unbiased=True, group=group)
    xs = x.to(mean.dtype)
    whitened = (xs - mean) * torch.rsqrt(var + _EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.to(x.dtype)


@torch.no_grad()
def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (``algorithm.adv_estimator=gae``).

    Args:
        token_level_rewards: [B, T] rewards (scores minus any in-reward KL penalty).
        values: [B, T] critic values of the rollout (old) policy.
        response_mask: [B, T].
        gamma, lam: ``algorithm.gamma`` and ``algorithm.lam``.
        group: process group over which the advantages are whitened (None: this rank only).

    Returns:
        advantages: [B, T] whitened GAE advantages, 0 on padding.
        returns: [B, T] ``advantages + values`` before whitening (the critic's regression target).

    Padding positions are skipped: the recursion carries the next real token's value and GAE through
    them unchanged, so rewards and values stored at padding never reach real tokens, and the value
    after the last real token is 0 (the episode ends at EOS).
    """
    mask = response_mask.to(values.dtype)
    rewards = token_level_rewards.to(values.dtype)
    batch, length = values.shape
    next_value = values.new_zeros(batch)
    last_gae = values.new_zeros(batch)
    advantages = torch.zeros_like(values)
    for t in reversed(range(length)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # On padding (m=0) keep the carried state so the next real token sees the real successor.
        next_value = values[:, t] * m + next_value * (1 - m)
        last_gae = gae_t * m + last_gae * (1 - m)
        advantages[:, t] = last_gae
    returns = advantages + values
    advantages = masked_whiten(advantages, mask, group=group) * mask
    return advantages, returns


def _group_ids(index: Sequence[Hashable] | Any, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary prompt uids to dense ids 0..G-1; returns ([B] long tensor, G)."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    if len(index) != batch:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch} rows.")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(uid, len(dense)) for uid in index]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def _group_mean_std(
    scores: torch.Tensor, gid: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased group std and group size, each [B].

    Groups of size 1 get mean 0 and std 1 (verl's convention: a lone sample keeps its raw score).
    """
    counts = scores.new_zeros(num_groups).index_add_(0, gid, torch.ones_like(scores))
    sums = scores.new_zeros(num_groups).index_add_(0, gid, scores)
    mean = sums / counts
    sq = scores.new_zeros(num_groups).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp_min(1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], counts[gid]


def _group_stats(
    scores: torch.Tensor, index: Sequence[Hashable] | Any, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_group_mean_std` of this rank's rows [B], the groups (rows of equal ``index``) taken over
    every rank of ``group``: the scores of a group that spans ranks come from all of them."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    gid, num_groups = _group_ids(index, scores.shape[0], scores.device)
    if group is None or dist.get_world_size(group) == 1:
        return _group_mean_std(scores, gid, num_groups)
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (list(index), scores.detach().cpu()), group=group)
    owners: dict[Hashable, set[int]] = {}
    for r, (uids, _) in enumerate(parts):
        for uid in uids:
            owners.setdefault(uid, set()).add(r)
    if all(len(ranks) == 1 for ranks in owners.values()):  # every group on one rank: as alone
        return _group_mean_std(scores, gid, num_groups)
    me = dist.get_rank(group)
    first = sum(len(uids) for uids, _ in parts[:me])
    everyone = torch.cat([t.to(scores.device, scores.dtype) for _, t in parts])
    all_gid, all_groups = _group_ids([u for uids, _ in parts for u in uids], everyone.shape[0], scores.device)
    mean, std, counts = _group_mean_std(everyone, all_gid, all_groups)
    mine = slice(first, first + scores.shape[0])
    return mean[mine], std[mine], counts[mine]


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    # [B, T] -> [B]: outcome score = sum of the rewards on real tokens, accumulated in >= float32.
    dtype = _stats_dtype(token_level_rewards)
    return (token_level_rewards.to(dtype) * response_mask.to(dtype)).sum(dim=-1)


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (``algorithm.adv_estimator=grpo``).

    Each sequence's score (sum of its token rewards) is normalised within its prompt group:
    ``(score - group_mean) / (group_std + epsilon)``, with the unbiased std of ``torch.std``; without
    ``norm_adv_by_std_in_grpo`` only the mean is subtracted (Dr. GRPO). A group of size 1 uses mean 0 and
    std 1. The scalar is broadcast over the sequence's response tokens.

    Args:
        token_level_rewards: [B, T].
        response_mask: [B, T].
        index: B prompt uids (any hashables); rows with equal uids form a group.
        group: process group over whose ranks' rows the groups are taken (None: this rank only).

    Returns:
        (advantages, returns), both [B, T] and identical, 0 on padding.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, std, _ = _group_stats(scores, index, group)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = (adv.unsqueeze(-1) * response_mask.to(adv.dtype)).to(token_level_rewards.dtype)
    return adv, adv


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO outcome advantage (``algorithm.adv_estimator=rloo``).

    ``score_i - mean(score_j for j != i in the group)``, computed as ``n/(n-1) * (score_i - group_mean)``.
    A group of size 1 has no baseline: its advantage is the raw score. With ``group`` the prompt groups
    are taken over every rank's rows.

    Returns:
        (advantages, returns), both [B, T] and identical, 0 on padding.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, n = _group_stats(scores, index, group)
    # For n == 1 mean is 0 and the factor is replaced by 1, leaving the raw score.
    factor = torch.where(n > 1, n / (n - 1).clamp_min(1), torch.ones_like(n))
    adv = (scores - mean) * factor
    adv = (adv.unsqueeze(-1) * response_mask.to(adv.dtype)).to(token_level_rewards.dtype)
    return adv, adv


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage (``algorithm.adv_estimator=reinforce_plus_plus``).

    The per-token discounted return-to-go ``G_t = r_t + gamma * G_{t+1}`` over the tokens the mask
    keeps, whitened over the whole batch (across ``group`` when given). A masked position (padding after
    EOS, or a zero inside the mask such as a tool's output in a multi-turn response) gets return 0, its
    reward is dropped, and the running return passes through it unchanged (no discount): rewards
    [0, 0, 0, 1] with mask [1, 0, 1, 1] and gamma 1 give returns [1, 0, 1, 1].

    Returns:
        advantages: [B, T] whitened returns, 0 on masked positions.
        returns: [B, T] the discounted returns before whitening, 0 on masked positions.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = token_level_rewards.new_zeros(token_level_rewards.shape[0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        candidate = token_level_rewards[:, t] + gamma * running
        returns[:, t] = candidate * m
        running = candidate * m + running * (1 - m)
    advantages = masked_whiten(returns, mask, group=group) * mask
    return advantages, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (``algorithm.adv_estimator=reinforce_plus_plus_baseline``).

    ``score - group_mean`` (a group of size 1 keeps its raw score), broadcast over the response tokens,
    then whitened over all masked tokens of the batch; with ``group`` both the prompt groups and the
    whitening span every rank.

    Returns:
        (advantages, returns), both [B, T] and identical, 0 on padding.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, _ = _group_stats(scores, index, group)
    mask = response_mask.to(scores.dtype)
    adv = (scores - mean).unsqueeze(-1) * mask
    adv = (masked_whiten(adv, mask, group=group) * mask).to(token_level_rewards.dtype)
    return adv, adv


@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG outcome advantage (``algorithm.adv_estimator=gpg``), as verl's ``compute_gpg_outcome_advantage``.

    ``alpha * (score - group_mean)`` with ``alpha = B / (number of sequences whose score is nonzero)``
    (at least 1 in the denominator), taken over the whole batch: with ``group``, B and the nonzero count
    are summed over every rank, as verl counts them on the driver's full batch. No division by the group
    std (verl computes it for GPG but leaves it unused, and its ``f_norm`` divisor is fixed at 1). A
    group of size 1 keeps ``alpha * score``. Pairs with ``policy_loss.loss_mode=gpg``.

    Args:
        token_level_rewards: [B, T].
        response_mask: [B, T].
        index: B prompt uids (any hashables); rows with equal uids form a group.
        group: process group over which B and the nonzero count are summed and the prompt groups
            taken (None: this rank only).

    Returns:
        (advantages, returns), both [B, T] and identical, 0 on padding.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B]
    mean, _, _ = _group_stats(scores, index, group)
    # counts: [sequences, sequences with a nonzero score]. verl counts nonzero scores, not nonzero
    # advantages: a group whose samples all score 1 still counts, one whose samples all score 0 does not.
    counts = torch.stack([scores.new_tensor(float(scores.shape[0])), (scores != 0).sum().to(scores.dtype)])
    if group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    alpha = counts[0] / counts[1].clamp_min(1.0)
    adv = alpha * (scores - mean)
    adv = (adv.unsqueeze(-1) * response_mask.to(adv.dtype)).to(token_level_rewards.dtype)
    return adv, adv


ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": compute_gae,
    "grpo": compute_grpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
}
"""``algorithm.adv_estimator`` value -> estimator. Signatures differ (gae needs values, the outcome
estimators need ``index``); the trainer passes the arguments each one takes."""


def get_adv_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The estimator for an ``algorithm.adv_estimator`` value; ValueError for an unknown name."""
    try:
        return ADV_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown advantage estimator {name!r} for `algorithm.adv_estimator`; "
            f"valid choices: {', '.join(ADV_ESTIMATORS)}."
        ) from None
