"""Policy-gradient losses, one per ``actor_rollout_ref.actor.policy_loss.loss_mode``.

Every mode maps per-token tensors ``[B, T]`` (log-probs of the sampled tokens under the behaviour
policy ``old_log_prob`` and the current policy ``log_prob``, advantages, the response mask and optional
rollout importance weights) to a scalar loss and three detached diagnostics, logged as verl logs them:
``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl`` and ``actor/pg_clipfrac_lower``.

With ``delta = log_prob - old_log_prob`` and ``r = exp(delta)``, per token (A the advantage, eps_l/eps_h
the clip ratios, sg() a stop-gradient):

    vanilla   max(-A r, -A clip(r, 1-eps_l, 1+eps_h)), capped at -A c for A < 0 (dual-clip, c = clip_ratio_c)
    gspo      the clipped surrogate with a sequence ratio s = exp(mean_t delta) whose gradient is
              s * grad(log_prob) per token (GSPO); aggregated by loss_agg_mode (GSPO's paper:
              seq-mean-token-mean)
    sapo      -sigmoid(tau (r - 1)) * 4/tau * A, tau = tau_pos for A > 0 else tau_neg (soft gate, SAPO);
              aggregated seq-mean-token-mean
    gpg       -A log_prob (plain policy gradient, GPG)
    cispo     -sg(clip(r, 1-eps_l, 1+eps_h)) A log_prob (clipped IS weight, never a zero gradient, CISPO)
    clip_cov  the clipped surrogate without dual-clip; a random clip_cov_ratio share of the unclipped
              tokens whose centred covariance (A - mean A)(log_prob - mean log_prob) lies in
              (clip_cov_lb, clip_cov_ub) get no gradient (Clip-Cov)
    kl_cov    -A r, plus ppo_kl_coef |delta| on the kl_cov_ratio share of tokens with the largest
              covariance (KL-Cov)
    dppo_tv   -A sg(min(r, c)) log_prob * keep (DPPO-Binary-TV), c = clip_ratio_c truncating the
              importance weight; keep = 1 unless the token's probability moved past the trust region on
              the side A pushes: p - p_old > eps_h for A > 0, p - p_old < -eps_l for A <= 0 (eps_l/eps_h
              are clip_ratio_low/high, read as bounds on the probability difference). pg_clipfrac is
              the share of tokens with keep = 0, pg_clipfrac_lower the share of kept tokens with r > c
    geo_mean  per sequence -mean_t(A) exp(mean_t clip_A(delta)), where clip_A clips delta in log space
              to eps_h from above for A > 0 and to -eps_l from below for A < 0 (GMPO); mean over sequences.
              Its pg_clipfrac / pg_clipfrac_lower count the tokens whose delta lies outside
              [-eps_l, eps_h] (either side) among those with A > 0 / A < 0, as verl counts them

Rollout importance weights (the mismatch correction, see ``rollout_corr``) multiply the per-token loss
before aggregation; geo_mean takes their per-sequence geometric mean.

Aggregation: see ``losses.agg_loss``. ``effective_agg_mode`` says which aggregation a mode uses (sapo
and geo_mean fix their own), so that the caller computes the matching global denominator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl.algos.advantages import masked_mean
from megatron_rl.algos.losses import agg_loss

__all__ = ["POLICY_LOSSES", "PolicyLossOptions", "compute_policy_loss", "effective_agg_mode"]


@dataclass(frozen=True)
class PolicyLossOptions:
    """Mode-specific constants (verl's ``actor_rollout_ref.actor.policy_loss.*`` and ``tau_*`` keys)."""

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05


@dataclass
class _Inputs:
    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    low: float
    high: float
    clip_ratio_c: float
    options: PolicyLossOptions
    generator: torch.Generator | None


# mode -> (per-token loss [B, T] or per-sequence loss [B], pg_clipfrac, ppo_kl, pg_clipfrac_lower)
_LossFn = Callable[[_Inputs], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

_FIXED_AGG = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def effective_agg_mode(loss_mode: str, loss_agg_mode: str) -> str:
    """The aggregation ``loss_mode`` applies: its own for sapo/geo_mean, else ``loss_agg_mode``."""
    return _FIXED_AGG.get(loss_mode, loss_agg_mode)


def _zero(x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros(())


def _vanilla(x: _Inputs):
    log_ratio = torch.clamp(x.log_prob - x.old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio.detach(), x.mask)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - x.low, 1.0 + x.high)
    loss_clip = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean(torch.gt(clipped, unclipped).float().detach(), x.mask)
    dual_bound = -x.advantages * x.clip_ratio_c
    negative = x.advantages < 0
    clipfrac_lower = masked_mean((torch.gt(loss_clip, dual_bound) & negative).float().detach(), x.mask)
    losses = torch.where(negative, torch.minimum(loss_clip, dual_bound), loss_clip)
    return losses, clipfrac, ppo_kl, clipfrac_lower


def _gspo(x: _Inputs):
    delta = x.log_prob - x.old_log_prob
    m = x.mask.to(delta.dtype)
    seq_log_ratio = (delta * m).sum(-1) / m.sum(-1).clamp_min(1.0)  # [B]
    # Value exp(seq_log_ratio) on every token; gradient exp(seq_log_ratio) * grad(log_prob) per token.
    token_log_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - x.low, 1.0 + x.high)
    clipfrac = masked_mean(torch.gt(clipped, unclipped).float().detach(), x.mask)
    return torch.maximum(unclipped, clipped), clipfrac, masked_mean(-delta.detach(), x.mask), _zero(delta)


def _sapo(x: _Inputs):
    log_ratio = torch.clamp(x.log_prob - x.old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(x.advantages > 0, x.options.tau_pos, x.options.tau_neg).to(ratio.dtype)
    losses = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * x.advantages
    return losses, _zero(ratio), masked_mean(-log_ratio.detach(), x.mask), _zero(ratio)


def _gpg(x: _Inputs):
    ppo_kl = masked_mean((x.old_log_prob - x.log_prob).detach(), x.mask)
    return -x.log_prob * x.advantages, _zero(x.log_prob), ppo_kl, _zero(x.log_prob)


def _cispo(x: _Inputs):
    log_ratio = torch.clamp(x.log_prob - x.old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - x.low, 1.0 + x.high)
    clipfrac = masked_mean(torch.ne(weight, ratio).float(), x.mask)
    losses = -weight * x.advantages * x.log_prob
    return losses, clipfrac, masked_mean(-log_ratio.detach(), x.mask), _zero(ratio)


def _dppo_tv(x: _Inputs):
    log_ratio = torch.clamp(x.log_prob - x.old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    # Truncated importance weight in place of dual-clip: detached, capped at clip_ratio_c.
    weight = torch.clamp(ratio, max=x.clip_ratio_c).detach()
    # Total variation between the old and new binary (this token / any other) distributions is
    # |p - p_old|; a token leaves the trust region only on the side its advantage pushes it.
    moved = (torch.exp(x.log_prob) - torch.exp(x.old_log_prob)).detach()
    keep = torch.where(x.advantages > 0, moved <= x.high, moved >= -x.low).to(x.log_prob.dtype)
    losses = -x.advantages * weight * x.log_prob * keep
    clipfrac = masked_mean(1.0 - keep, x.mask)
    clipfrac_lower = masked_mean((ratio > x.clip_ratio_c).to(keep.dtype).detach() * keep, x.mask)
    return losses, clipfrac, masked_mean(-log_ratio.detach(), x.mask), clipfrac_lower


def _centred_covariance(x: _Inputs) -> torch.Tensor:
    """(A - mean A) * (log_prob - mean log_prob) per token, means over the masked tokens; detached."""
    adv, logp = x.advantages.detach(), x.log_prob.detach()
    return (adv - masked_mean(adv, x.mask)) * (logp - masked_mean(logp, x.mask))


def _clip_cov(x: _Inputs):
    delta = x.log_prob - x.old_log_prob
    ratio = torch.exp(delta)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - x.low, 1.0 + x.high)
    ppo_clipped = torch.gt(clipped, unclipped)
    cov = _centred_covariance(x)
    eligible = (x.mask > 0) & ~ppo_clipped & (cov > x.options.clip_cov_lb) & (cov < x.options.clip_cov_ub)
    candidates = eligible.flatten().nonzero().squeeze(-1)
    keep = torch.ones_like(delta).flatten()
    if candidates.numel():
        budget = max(1, int(x.mask.sum().item() * x.options.clip_cov_ratio))
        order = torch.randperm(candidates.numel(), generator=x.generator).to(candidates.device)
        keep[candidates[order[:budget]]] = 0.0
    keep = keep.view_as(delta)
    losses = torch.maximum(unclipped, clipped) * keep
    clipfrac = masked_mean((keep == 0).float(), x.mask)
    return losses, clipfrac, masked_mean(-delta.detach(), x.mask), _zero(delta)


def _kl_cov(x: _Inputs):
    delta = x.log_prob - x.old_log_prob
    losses = -x.advantages * torch.exp(delta)
    valid = (x.mask > 0).flatten()
    n_valid = int(valid.sum().item())
    if n_valid:
        k = max(1, int(n_valid * x.options.kl_cov_ratio))
        cov = _centred_covariance(x).flatten().masked_fill(~valid, float("-inf"))
        top = torch.topk(cov, min(k, n_valid)).indices
        penalty = torch.zeros_like(losses).flatten()
        penalty[top] = 1.0
        losses = losses + x.options.ppo_kl_coef * delta.abs() * penalty.view_as(losses)
    return losses, _zero(delta), masked_mean(delta.detach().abs(), x.mask), _zero(delta)


def _geo_mean(x: _Inputs):
    delta = x.log_prob - x.old_log_prob
    m = x.mask.to(delta.dtype)
    clipped = torch.clamp(delta, -x.low, x.high)
    a = x.advantages
    # Log-space clip on the side the advantage pushes: up for A > 0, down for A < 0.
    gated = torch.where(a > 0, torch.minimum(delta, clipped), torch.maximum(delta, clipped))
    gated = torch.where(a == 0, torch.zeros_like(delta), gated)
    n = m.sum(-1).clamp_min(1.0)
    seq_ratio = torch.exp((gated * m).sum(-1) / n)  # [B]
    seq_adv = (a * m).sum(-1) / n
    seq_losses = -seq_adv * seq_ratio  # [B]
    # A token counts as clipped when its delta leaves [-eps_l, eps_h] on either side (verl's count).
    outside = (delta != clipped).detach()
    clipfrac = masked_mean((outside & (a > 0)).float(), x.mask)
    clipfrac_lower = masked_mean((outside & (a < 0)).float(), x.mask)
    return seq_losses, clipfrac, masked_mean(-delta.detach(), x.mask), clipfrac_lower


POLICY_LOSSES: dict[str, _LossFn] = {
    "vanilla": _vanilla,
    "gspo": _gspo,
    "sapo": _sapo,
    "gpg": _gpg,
    "cispo": _cispo,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "geo_mean": _geo_mean,
    "dppo_tv": _dppo_tv,
}
"""``actor_rollout_ref.actor.policy_loss.loss_mode`` value -> per-token (geo_mean: per-sequence) loss."""


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
    *,
    loss_mode: str = "vanilla",
    options: PolicyLossOptions | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy loss of ``loss_mode`` (see the module docstring).

    Args:
        old_log_prob, log_prob: [B, T] log-probs of the sampled tokens under the behaviour and current policy.
        advantages, response_mask: [B, T].
        clip_ratio: default for both sides; ``clip_ratio_low`` / ``clip_ratio_high`` override one side
            (for dppo_tv: bounds on the probability difference p - p_old, not on the ratio).
        clip_ratio_c: dual-clip bound of ``vanilla``, the importance-weight cap of ``dppo_tv``; must be > 1.
        loss_agg_mode, global_denominator, loss_scale_factor: see ``agg_loss``; for sapo and
            geo_mean the denominator must count sequences (``effective_agg_mode``).
        rollout_is_weights: [B, T] detached importance weights, or None.
        generator: the random source of clip_cov's token choice (the same on the tensor-parallel peers
            of one model replica, whose losses must agree).

    Returns:
        pg_loss (differentiable) and detached pg_clipfrac, ppo_kl, pg_clipfrac_lower.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c} must be > 1.0 "
            "(dual-clip caps the loss of negative-advantage tokens at clip_ratio_c * |A|)."
        )
    if loss_mode not in POLICY_LOSSES:
        raise ValueError(
            f"Unknown policy loss {loss_mode!r} for `actor_rollout_ref.actor.policy_loss.loss_mode`; "
            f"valid choices: {', '.join(POLICY_LOSSES)}."
        )
    x = _Inputs(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio if clip_ratio_high is None else clip_ratio_high,
        clip_ratio_c,
        options or PolicyLossOptions(),
        generator,
    )
    losses, clipfrac, ppo_kl, clipfrac_lower = POLICY_LOSSES[loss_mode](x)
    mode = effective_agg_mode(loss_mode, loss_agg_mode)
    if loss_mode == "geo_mean":
        m = response_mask.to(losses.dtype)
        if rollout_is_weights is not None:
            log_w = (torch.log(rollout_is_weights.clamp_min(1e-8)) * m).sum(-1) / m.sum(-1).clamp_min(1.0)
            losses = losses * torch.exp(log_w)
        # [B] -> [B, 1]: a sequence's loss counted once, sequences without tokens left out.
        pg_loss = agg_loss(
            losses[:, None], (m.sum(-1, keepdim=True) > 0), "seq-mean-token-sum", global_denominator
        )
        return pg_loss, clipfrac, ppo_kl, clipfrac_lower
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    pg_loss = agg_loss(losses, response_mask, mode, global_denominator, loss_scale_factor)
    return pg_loss, clipfrac, ppo_kl, clipfrac_lower
