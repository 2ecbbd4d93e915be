"""Loss aggregation and the critic's value loss (the policy losses are in ``policy_loss``).

The trainer logs ``compute_value_loss`` as ``critic/vf_loss`` and ``critic/vf_clipfrac``.

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

from megatron_rl.algos.advantages import masked_mean

__all__ = ["LOSS_AGG_MODES", "agg_loss", "compute_value_loss"]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

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
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (``actor_rollout_ref.actor.loss_agg_mode`` /
    ``critic.loss_agg_mode``).

    - ``token-mean``: sum over all masked tokens / number of masked tokens.
    - ``token-sum``: sum over all masked tokens (no normalisation).
    - ``seq-mean-token-sum``: per sequence, sum over its tokens; then mean over sequences.
    - ``seq-mean-token-mean``: per sequence, mean over its tokens; then mean over sequences.
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by the constant ``loss_scale_factor``
      (Dr. GRPO: a fixed length, so long and short responses weigh their tokens alike); when None, the
      padded width ``T``.

    Sequences with no masked token (e.g. padding rows) contribute 0 and are not counted in the
    sequence mean; an all-padding batch gives 0, never NaN.

    ``global_denominator`` replaces the local count: the number of masked tokens (``token-mean``) or of
    sequences with at least one masked token (``seq-*``) in the whole mini-batch across micro-batches and
    data-parallel ranks (``token-sum`` ignores it). The result is then this micro-batch's additive share of
    the mini-batch loss (see the module docstring).
    """
    mask = loss_mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if loss_agg_mode in ("token-mean", "token-sum"):
        numerator = masked.sum()
        if loss_agg_mode == "token-sum":
            return numerator
        local_count = mask.sum()
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        tokens_per_seq = mask.sum(dim=-1)  # [B]
        seq_losses = masked.sum(dim=-1)  # [B]
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = _divide(seq_losses, tokens_per_seq)
        numerator = seq_losses.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            numerator = numerator / (loss_scale_factor or loss_mask.shape[-1])
        local_count = (tokens_per_seq > 0).to(loss_mat.dtype).sum()
    else:
        raise ValueError(
            f"Unknown loss aggregation mode {loss_agg_mode!r} for `actor_rollout_ref.actor.loss_agg_mode` "
            f"(or `critic.loss_agg_mode`); valid choices: {', '.join(LOSS_AGG_MODES)}."
        )
    denominator = local_count if global_denominator is None else global_denominator
    return _divide(numerator, denominator)


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_denominator: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2)``.

    Args:
        vpreds: [B, T] current critic predictions (differentiable).
        values: [B, T] critic values at rollout time (``V_old``).
        returns: [B, T] regression targets.
        response_mask: [B, T].
        cliprange_value: ``critic.cliprange_value``.
        loss_agg_mode, global_denominator, loss_scale_factor: see ``agg_loss``.

    Returns:
        vf_loss (``critic/vf_loss``) and detached vf_clipfrac (``critic/vf_clipfrac``: fraction of tokens
        where the clipped term is larger).

    Pass the arguments by keyword: verl orders ``returns`` before ``values``.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(loss_mat, response_mask, loss_agg_mode, global_denominator, loss_scale_factor)
    vf_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float().detach(), response_mask)
    return vf_loss, vf_clipfrac
