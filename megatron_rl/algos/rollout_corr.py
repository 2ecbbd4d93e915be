"""Rollout-training mismatch: how far the engine's log-probs are from the trainer's, and corrections.

The engine samples with its own kernels (and in bf16), so the log-probability it assigns to a sampled
token differs from the one the trainer recomputes for the same weights. With ``rho = pi_train /
pi_rollout`` per token (``log rho = old_log_prob - rollout_log_prob``), over the response tokens:

    mismatch_metrics     (always, when the engine returned log-probs)
        training/rollout_probs_diff_{mean,max,std}   |exp(old_log_prob) - exp(rollout_log_prob)|
        training/rollout_actor_probs_pearson_corr    correlation of the two token probabilities
        rollout_corr/kl        mean(rollout_log_prob - old_log_prob)   KL(rollout || train), k1
        rollout_corr/k3_kl     mean(rho - 1 - log rho)                 the same KL, k3 (>= 0)
        rollout_corr/{training,rollout}_ppl           mean over sequences of exp(-mean token log-prob)
        rollout_corr/log_ppl_diff, log_ppl_abs_diff   per sequence mean rollout lp - mean training lp
        rollout_corr/chi2_token, chi2_seq             E[rho^2] - 1 per token and per sequence

    missing_log_probs    response tokens the engine gave no log-prob for (NaN) and all response
                         tokens; ``rollout_corr/missing_log_probs`` is their ratio

    importance_weights   (``algorithm.rollout_correction.rollout_is``: token | sequence)
        truncated IS (TIS): w = min(rho, T) per token, or min(prod_t rho_t, T) per sequence, detached,
        multiplied into the per-token policy loss; T = rollout_is_threshold. A threshold "L_U" is
        IcePop instead: w = rho inside [L, U], 0 outside. Optionally divided by the batch mean
        (rollout_is_batch_normalize: over tokens, or over sequences at sequence level).

    rejection_mask       (``algorithm.rollout_correction.rollout_rs``: a comma list)
        masked IS (MIS) / rejection sampling: tokens or whole sequences whose divergence statistic
        leaves its bounds get mask 0 (no loss, no advantage). Options are <level>_<estimator>:
        token_k*, seq_sum_k*, seq_mean_k*, seq_max_k2|k3 with k1 = -log rho, k2 = (log rho)^2 / 2,
        k3 = rho - 1 - log rho. A k1 option keeps lower <= pi_rollout/pi_train <= upper (threshold
        "lower_upper", or U meaning 1/U .. U); k2/k3 options keep statistic <= threshold.
        ``seq_sum_k1`` with "0.5_2.0" is sequence-level MIS on the sequence ratio.

All statistics are over the data-parallel group (every rank gets the same numbers).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "RS_OPTIONS",
    "importance_weights",
    "mismatch_metrics",
    "missing_log_probs",
    "parse_is_threshold",
    "parse_rs",
    "rejection_mask",
]

RS_OPTIONS = tuple(
    [f"token_k{i}" for i in (1, 2, 3)]
    + [f"seq_sum_k{i}" for i in (1, 2, 3)]
    + [f"seq_mean_k{i}" for i in (1, 2, 3)]
    + ["seq_max_k2", "seq_max_k3"]
)


def _sum(t: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _log_rho(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(old_log_prob.double() - rollout_log_prob.double(), -20.0, 20.0)


@torch.no_grad()
def missing_log_probs(
    rollout_log_prob: torch.Tensor, mask: torch.Tensor, group: ProcessGroup | None = None
) -> tuple[float, float]:
    """(tokens under ``mask`` whose ``rollout_log_prob`` [B, T] is NaN, tokens under ``mask``), summed
    over the ranks of ``group``."""
    on = mask > 0
    counts = torch.stack([(rollout_log_prob.isnan() & on).double().sum(), on.double().sum()])
    n_missing, n_tokens = _sum(counts, group).tolist()
    return n_missing, n_tokens


@torch.no_grad()
def mismatch_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    group: ProcessGroup | None = None,
) -> dict[str, float]:
    """The mismatch metrics of the module docstring over the masked tokens [B, T] of every rank."""
    m = mask.double()
    lr = _log_rho(old_log_prob, rollout_log_prob) * m
    p_train, p_roll = old_log_prob.double().exp() * m, rollout_log_prob.double().exp() * m
    diff = (p_train - p_roll).abs()
    n_tok = m.sum(-1)
    seq = n_tok > 0
    mean_train = (old_log_prob.double() * m).sum(-1) / n_tok.clamp_min(1)
    mean_roll = (rollout_log_prob.double() * m).sum(-1) / n_tok.clamp_min(1)
    log_ppl_diff = (mean_roll - mean_train)[seq]
    sums = torch.stack(
        [
            m.sum(),
            diff.sum(),
            diff.square().sum(),
            (-lr).sum(),  # rollout lp - train lp
            ((lr.exp() - 1 - lr) * m).sum(),
            ((torch.exp(2 * lr) - 1) * m).sum(),
            p_train.sum(),
            p_roll.sum(),
            (p_train * p_roll).sum(),
            p_train.square().sum(),
            p_roll.square().sum(),
            seq.double().sum(),
            torch.exp(-mean_train[seq]).sum(),
            torch.exp(-mean_roll[seq]).sum(),
            log_ppl_diff.sum(),
            log_ppl_diff.abs().sum(),
            (torch.exp(2 * torch.clamp(lr.sum(-1)[seq], -20.0, 20.0)) - 1).sum(),
        ]
    )
    _sum(sums, group)
    peak = _sum(diff.max().reshape(1) if diff.numel() else diff.new_zeros(1), group, dist.ReduceOp.MAX)
    (n, d1, d2, kl, k3, chi_tok, st, sr, stt_r, stt, srr, n_seq, ppl_t, ppl_r, lpd, lpd_abs, chi_seq) = (
        sums.tolist()
    )
    n, n_seq = max(n, 1.0), max(n_seq, 1.0)
    mean_diff = d1 / n
    cov = stt_r / n - (st / n) * (sr / n)
    var_t, var_r = stt / n - (st / n) ** 2, srr / n - (sr / n) ** 2
    return {
        "training/rollout_probs_diff_mean": mean_diff,
        "training/rollout_probs_diff_max": peak.item(),
        # unbiased (n - 1), as torch.std
        "training/rollout_probs_diff_std": math.sqrt(max((d2 - n * mean_diff**2) / max(n - 1, 1.0), 0.0)),
        "training/rollout_actor_probs_pearson_corr": cov / math.sqrt(max(var_t * var_r, 1e-30)),
        "rollout_corr/kl": kl / n,
        "rollout_corr/k3_kl": k3 / n,
        "rollout_corr/chi2_token": chi_tok / n,
        "rollout_corr/training_ppl": ppl_t / n_seq,
        "rollout_corr/rollout_ppl": ppl_r / n_seq,
        "rollout_corr/log_ppl_diff": lpd / n_seq,
        "rollout_corr/log_ppl_abs_diff": lpd_abs / n_seq,
        "rollout_corr/chi2_seq": chi_seq / n_seq,
    }


def parse_is_threshold(threshold: str | float) -> tuple[float | None, float]:
    """``rollout_is_threshold`` -> (lower, upper): a number U is truncation at U (TIS, lower None);
    "lower_upper" zeroes the weights outside [lower, upper] (IcePop). ValueError naming the key."""
    text = str(threshold).strip()
    try:
        bounds = [float(x) for x in text.split("_")]
    except ValueError:
        bounds = []
    if len(bounds) == 1 and bounds[0] > 0 and not isinstance(threshold, bool):
        return None, bounds[0]
    if len(bounds) == 2 and 0 < bounds[0] <= bounds[1]:
        return bounds[0], bounds[1]
    raise ValueError(
        f"algorithm.rollout_correction.rollout_is_threshold={threshold!r}: expected a number U > 0 "
        "(truncate at U) or 'lower_upper' with 0 < lower <= upper (IcePop: zero outside the bounds)."
    )


@torch.no_grad()
def importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: str | float,
    batch_normalize: bool = False,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights [B, T] (0 off the mask) for ``level`` token | sequence, and their metrics,
    defined as verl defines them:

    - ``rollout_is_mean``: token-weighted mean of the weights after truncation (IcePop: zeroing);
      ``rollout_is_max``/``_min``: token level, of the weights after truncation; sequence level, of
      the raw sequence ratios (what truncation hides).
    - ``rollout_is_ratio_fraction_high``/``_low``: share of the raw ratios above the upper bound /
      below the lower one (1/upper for TIS): of the tokens (token level) or of the sequences
      (sequence level). ``rollout_is_oob_ratio`` (IcePop): share of the tokens zeroed.
    - ``rollout_is_batch_norm_factor`` (``batch_normalize``): the mean the weights are divided by:
      over tokens (token level) or over sequences, one weight each (sequence level).
    """
    if level not in ("token", "sequence"):
        raise ValueError(
            f"algorithm.rollout_correction.rollout_is={level!r}: use token, sequence or null (off)."
        )
    lower, upper = parse_is_threshold(threshold)
    m = mask.double()
    has = m.sum(-1) > 0  # [B] sequences with response tokens
    lr = _log_rho(old_log_prob, rollout_log_prob) * m
    if level == "sequence":
        seq_lr = torch.clamp(lr.sum(-1), -20.0, 20.0)  # [B]
        lr = seq_lr[:, None].expand_as(m)
    raw = lr.exp() * m
    if lower is None:
        w = torch.clamp(raw, max=upper)
        oob = torch.zeros_like(m)
    else:
        keep = (raw >= lower) & (raw <= upper)
        w = torch.where(keep, raw, torch.zeros_like(raw))
        oob = (~keep).double() * m
    low_bound = 1.0 / upper if lower is None else lower
    if level == "token":
        units, high, low = m, (raw > upper) * m, (raw < low_bound) * m
        peak, floor = torch.where(m > 0, w, -math.inf), torch.where(m > 0, w, math.inf)
    else:
        seq_raw = seq_lr.exp()
        units = has.double()
        high, low = ((seq_raw > upper) & has).double(), ((seq_raw < low_bound) & has).double()
        peak, floor = torch.where(has, seq_raw, -math.inf), torch.where(has, seq_raw, math.inf)
    sums = _sum(torch.stack([m.sum(), w.sum(), units.sum(), high.sum(), low.sum(), oob.sum()]), group)
    ext = _sum(
        torch.stack(
            [
                peak.max() if peak.numel() else peak.new_tensor(-math.inf),
                -(floor.min() if floor.numel() else floor.new_tensor(math.inf)),
            ]
        ),
        group,
        dist.ReduceOp.MAX,
    )
    n_tok, w_sum, n_units, n_high, n_low, n_oob = sums.tolist()
    n_tok, n_units = max(n_tok, 1.0), max(n_units, 1.0)
    metrics = {
        "rollout_corr/rollout_is_mean": w_sum / n_tok,
        "rollout_corr/rollout_is_max": ext[0].item(),
        "rollout_corr/rollout_is_min": -ext[1].item(),
        "rollout_corr/rollout_is_ratio_fraction_high": n_high / n_units,
        "rollout_corr/rollout_is_ratio_fraction_low": n_low / n_units,
    }
    if lower is not None:
        metrics["rollout_corr/rollout_is_oob_ratio"] = n_oob / n_tok
    if batch_normalize:
        if level == "token":
            mean = w_sum / n_tok
        else:  # one weight per sequence: the sequence's (constant) weight, averaged over sequences
            seq_w = w.sum(-1) / m.sum(-1).clamp_min(1)
            mean = _sum(seq_w[has].sum().reshape(1), group).item() / n_units
        factor = 1.0
        if mean > 1e-8:
            w = w / mean
            factor = mean
        metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor
    return w.to(old_log_prob.dtype), metrics


def parse_rs(options: str, thresholds: str | float | None) -> list[tuple[str, float, float]]:
    """``rollout_rs`` and ``rollout_rs_threshold`` -> [(option, lower, upper)]; ValueError naming the key."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs: unknown option {name!r}; choose from "
                f"{', '.join(RS_OPTIONS)} (comma separated)."
            )
    if thresholds is None or str(thresholds).strip() == "":
        raise ValueError(
            "algorithm.rollout_correction.rollout_rs is set but rollout_rs_threshold is not: give one bound "
            "for all options or one per option, comma separated (k1: 'lower_upper' or U for 1/U..U)."
        )
    parts = [t.strip() for t in str(thresholds).split(",")]
    if len(parts) == 1:
        parts *= len(names)
    if len(parts) != len(names):
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs_threshold has {len(parts)} entries for "
            f"{len(names)} rollout_rs options: give one, or one per option."
        )
    out = []
    for name, part in zip(names, parts, strict=True):
        try:
            bounds = [float(x) for x in part.split("_")]
        except ValueError:
            bounds = []
        k1 = name.endswith("k1")
        if k1 and len(bounds) == 1 and bounds[0] > 0:
            bounds = [1 / bounds[0], bounds[0]]
        ok = (len(bounds) == 2 and 0 < bounds[0] <= bounds[1]) if k1 else (len(bounds) == 1 and bounds[0] > 0)
        if not ok:
            want = "'lower_upper' with 0 < lower <= upper, or U > 0" if k1 else "one number > 0"
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs_threshold={part!r} for {name}: expected {want}."
            )
        out.append((name, bounds[0] if k1 else 0.0, bounds[-1]))
    return out


@torch.no_grad()
def rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    options: list[tuple[str, float, float]],
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``mask`` [B, T] with the rejected tokens (or sequences) set to 0, and
    ``rollout_corr/rollout_rs_masked_fraction`` (tokens) / ``rollout_rs_seq_masked_fraction``."""
    m = mask.double()
    lr = _log_rho(old_log_prob, rollout_log_prob)
    estimators = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": lr.exp() - 1 - lr}
    keep = m > 0
    for name, lower, upper in options:
        level, est = name.rsplit("_", 1)
        stat = estimators[est] * m
        if level == "seq_sum":
            stat = stat.sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = stat.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
        elif level == "seq_max":
            stat = torch.where(m > 0, stat, -math.inf).max(-1, keepdim=True).values
        if est == "k1":
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            ok = stat <= upper
        keep = keep & ok.expand_as(keep)
    new_mask = keep.to(mask.dtype) * mask
    had = (m.sum(-1) > 0).double()
    lost = ((new_mask.double().sum(-1) < m.sum(-1)) & (had > 0)).double()
    sums = _sum(torch.stack([m.sum(), m.sum() - new_mask.double().sum(), had.sum(), lost.sum()]), group)
    n, rejected, n_seq, seq_rejected = sums.tolist()
    return new_mask, {
        "rollout_corr/rollout_rs_masked_fraction": rejected / max(n, 1.0),
        "rollout_corr/rollout_rs_seq_masked_fraction": seq_rejected / max(n_seq, 1.0),
    }
