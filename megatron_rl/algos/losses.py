"""PPO actor and critic losses, loss aggregation and explained variance.

Functions return tensors; the trainer logs them under verl's metric names:

- ``compute_policy_loss`` -> ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``,
  ``actor/pg_clipfrac_lower``
- ``compute_entropy_loss`` -> ``actor/entropy``
- ``compute_value_loss`` -> ``critic/vf_loss``, ``critic/vf_clipfrac``
- ``explained_variance`` -> ``critic/vf_explained_var``

Gradient accumulation and data parallelism
------------------------------------------
By default every aggregation divides by the *local* count (tokens or sequences of the micro-batch),
so summing micro-batch losses weights micro-batches equally whatever their token counts. Passing
``global_denominator`` (the count over the whole mini-batch: all micro-batches on all data-parallel
ranks) makes each call return that micro-batch's share of the mini-batch mean instead: the sum of the
returned losses over micro-batches and ranks, and hence the sum of their gradients, equals the loss of
the whole mini-batch. Note that Megatron's data-parallel gradient reduction averages over ranks by
default; scale the loss by the data-parallel world size (or reduce gradients with a sum) to keep the
equality. Clip fractions and ``ppo_kl`` are diagnostics and always use local counts.
"""

from __future__ import annotations

import torch

from megatron_rl.algos.advantages import masked_mean, masked_var

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "compute_entropy_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "explained_variance",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# Floor for denominators: a count of 0 comes with a numerator of exactly 0, so the quotient is 0.
_TINY = 1e-8


def _divide(numerator: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    den = torch.as_tensor(denominator, dtype=numerator.dtype, device=numerator.device)
    return numerator / den.clamp_min(_TINY)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (``actor_rollout_ref.actor.loss_agg_mode`` /
    ``critic.loss_agg_mode``).

    - ``token-mean``: sum over all masked tokens / number of masked tokens.
    - ``seq-mean-token-sum``: per sequence, sum over its tokens; then mean over sequences.
    - ``seq-mean-token-mean``: per sequence, mean over its tokens; then mean over sequences.

    Sequences with no masked token (e.g. padding rows) contribute 0 and are not counted in the
    sequence mean; an all-padding batch gives 0, never NaN.

    ``global_denominator`` replaces the local count: the number of masked tokens (``token-mean``) or of
    sequences with at least one masked token (``seq-*``) in the whole mini-batch across micro-batches and
    data-parallel ranks. The result is then this micro-batch's additive share of the mini-batch loss
    (see the module docstring).
    """
    mask = loss_mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if loss_agg_mode == "token-mean":
        numerator = masked.sum()
        local_count = mask.sum()
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        tokens_per_seq = mask.sum(dim=-1)  # [B]
        seq_losses = masked.sum(dim=-1)  # [B]
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = _divide(seq_losses, tokens_per_seq)
        numerator = seq_losses.sum()
        local_count = (tokens_per_seq > 0).to(loss_mat.dtype).sum()
    else:
        raise ValueError(
            f"Unknown loss aggregation mode {loss_agg_mode!r} for `actor_rollout_ref.actor.loss_agg_mode` "
            f"(or `critic.loss_agg_mode`); valid choices: {', '.join(LOSS_AGG_MODES)}."
        )
    denominator = local_count if global_denominator is None else global_denominator
    return _divide(numerator, denominator)


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with clip-higher and dual-clip.

    With ``ratio = exp(log_prob - old_log_prob)`` (log ratio clamped to [-20, 20] so ``exp`` stays
    finite), the per-token loss is ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``; for A < 0
    it is further capped at ``-A * clip_ratio_c`` (dual-clip, Ye et al. 2020), which bounds the update
    when a token the policy now strongly prefers has a negative advantage.

    Args:
        old_log_prob, log_prob: [B, T] log-probs of the sampled tokens under the rollout and current policy.
        advantages: [B, T].
        response_mask: [B, T].
        clip_ratio: default for both sides; ``clip_ratio_low`` / ``clip_ratio_high`` override one side
            (DAPO's clip-higher uses a larger high).
        clip_ratio_c: dual-clip bound, must be > 1.
        loss_agg_mode, global_denominator: see ``agg_loss``.

    Returns:
        pg_loss (``actor/pg_loss``, differentiable), and detached diagnostics: pg_clipfrac
        (``actor/pg_clipfrac``: fraction of tokens where the clipped term is active), ppo_kl
        (``actor/ppo_kl``: masked mean of ``old_log_prob - log_prob``) and pg_clipfrac_lower
        (``actor/pg_clipfrac_lower``: fraction of tokens where dual-clip is active).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c} must be > 1.0 "
            "(dual-clip caps the loss of negative-advantage tokens at clip_ratio_c * |A|)."
        )
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio.detach(), response_mask)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss_clip = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).float().detach(), response_mask)

    dual_bound = -advantages * clip_ratio_c
    loss_dual = torch.minimum(loss_clip, dual_bound)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(
        (torch.gt(loss_clip, dual_bound) & negative).float().detach(), response_mask
    )
    pg_losses = torch.where(negative, loss_dual, loss_clip)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_denominator)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2)``.

    Args:
        vpreds: [B, T] current critic predictions (differentiable).
        values: [B, T] critic values at rollout time (``V_old``).
        returns: [B, T] regression targets.
        response_mask: [B, T].
        cliprange_value: ``critic.cliprange_value``.
        loss_agg_mode, global_denominator: see ``agg_loss``.

    Returns:
        vf_loss (``critic/vf_loss``) and detached vf_clipfrac (``critic/vf_clipfrac``: fraction of tokens
        where the clipped term is larger).

    Pass the arguments by keyword: verl orders ``returns`` before ``values``.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(loss_mat, response_mask, loss_agg_mode, global_denominator)
    vf_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float().detach(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_denominator: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Aggregated per-token entropy [B, T] -> scalar (``actor/entropy``).

    The actor loss is ``pg_loss - entropy_coeff * entropy_loss``.
    """
    return agg_loss(entropy, response_mask, loss_agg_mode, global_denominator)


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over masked tokens (``critic/vf_explained_var``).

    1 means the critic predicts the returns perfectly, 0 means it does no better than their mean, and
    negative values mean worse than that. A tiny constant (1e-5) guards a zero-variance target.
    """
    var_returns = masked_var(returns.float(), mask, unbiased=False)
    var_residual = masked_var((returns - values).float(), mask, unbiased=False)
    return 1.0 - var_residual / (var_returns + 1e-5)
