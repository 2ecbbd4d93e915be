"""verl's algorithm variants against numbers worked out by hand in each test: REINFORCE++ across mask
zeros, straight-through KL, the policy-loss modes, rollout importance weights and rejection, the
mismatch metrics, DAPO's group filter and overlong shaping."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import (
    POLICY_LOSSES,
    PolicyLossOptions,
    compute_policy_loss,
    compute_reinforce_plus_plus_outcome_advantage,
    effective_agg_mode,
    kl_penalty,
)
from megatron_rl.algos.dapo import informative_groups, overlong_penalty
from megatron_rl.algos.rollout_corr import importance_weights, mismatch_metrics, parse_rs, rejection_mask


def T(rows) -> torch.Tensor:
    return torch.as_tensor(rows, dtype=torch.float64)


def close(actual, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), T(expected), atol=atol, rtol=1e-6
    )


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_carries_the_return_across_a_zero_inside_the_mask():
    rewards, mask = T([[0, 0, 0, 1]]), T([[1, 0, 1, 1]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=1.0)
    close(ret, [[1, 0, 1, 1]])  # the masked token gets 0; the token before it still sees the reward
    # gamma 0.5: the masked position is skipped without a discount: G3 = 1, G2 = .5, G0 = .25
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0, 0.5, 1]])
    # a reward on a masked position is dropped
    _, ret = compute_reinforce_plus_plus_outcome_advantage(T([[0, 5, 0, 1]]), mask, gamma=1.0)
    close(ret, [[1, 0, 1, 1]])


# ---------------------------------------------------------------- KL straight-through


@pytest.mark.parametrize("base", ["k1", "kl", "k3", "low_var_kl", "abs", "k2"])
def test_plus_variants_keep_the_value_and_take_the_k2_gradient(base):
    logp = T([-1.0, -2.0, -0.5]).requires_grad_(True)
    ref = T([-1.5, -1.0, -0.5])
    value = kl_penalty(logp, ref, base + "+")
    close(value.detach(), kl_penalty(logp.detach(), ref, base))
    value.sum().backward()
    close(logp.grad, [0.5, -1.0, 0.0])  # d/dlogp of (logp - ref)^2 / 2 = logp - ref
    # negative control: without "+" the k1 gradient is 1 everywhere
    plain = T([-1.0, -2.0, -0.5]).requires_grad_(True)
    kl_penalty(plain, ref, "k1").sum().backward()
    close(plain.grad, [1.0, 1.0, 1.0])


# ---------------------------------------------------------------- policy-loss modes

OLD = T([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
# ratios 1.5, 0.5, 1.1 | 2.0, 0.9, (padding)
NEW = torch.log(T([[1.5, 0.5, 1.1], [2.0, 0.9, 7.0]]))
ADV = T([[1.0, -1.0, 2.0], [-1.0, 0.5, 9.0]])
MASK = T([[1, 1, 1], [1, 1, 0]])


def _loss(mode: str, **kw) -> tuple[torch.Tensor, ...]:
    new = NEW.clone().requires_grad_(True)
    out = compute_policy_loss(OLD, new, ADV, MASK, clip_ratio=0.2, loss_mode=mode, **kw)
    out[0].backward()
    return (*out, new.grad)


def test_gspo_uses_the_sequence_ratio_and_a_sequence_mean():
    pg, clipfrac, _, lower, grad = _loss("gspo", loss_agg_mode="seq-mean-token-mean")
    s0 = math.exp((math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3)  # 0.9380
    s1 = math.exp((math.log(2.0) + math.log(0.9)) / 2)  # 1.3416
    # row 0: every token ratio s0 (inside [0.8, 1.2]): -A * s0 -> mean (-1 + 1 - 2) s0 / 3
    row0 = (-1.0 * s0 + 1.0 * s0 - 2.0 * s0) / 3
    # row 1: s1 > 1.2. A=-1: max(s1, 1.2) = s1 (unclipped); A=.5: max(-.5 s1, -.6) = -.6 (clipped)
    row1 = (s1 + -0.6) / 2
    close(pg, (row0 + row1) / 2)
    close(clipfrac, 1 / 5)
    close(lower, 0.0)
    # gradient: d(-A s)/dlogp_t = -A s per token, / tokens of the row / 2 rows; a clipped token has none
    close(grad, [[-s0 / 6, s0 / 6, -2 * s0 / 6], [s1 / 4, 0.0, 0.0]])
    # GSPO aggregates as loss_agg_mode says (as verl's does): token-mean over the 5 tokens
    assert effective_agg_mode("gspo", "token-mean") == "token-mean"
    pg, *_ = _loss("gspo", loss_agg_mode="token-mean")
    close(pg, (3 * row0 + 2 * row1) / 5)


def test_cispo_clips_a_detached_weight_and_always_keeps_a_gradient():
    pg, clipfrac, _, _, grad = _loss("cispo", loss_agg_mode="token-mean")
    w = [[1.2, 0.8, 1.1], [1.2, 0.9]]
    lp = [[math.log(1.5), math.log(0.5), math.log(1.1)], [math.log(2.0), math.log(0.9)]]
    a = [[1.0, -1.0, 2.0], [-1.0, 0.5]]
    total = sum(-w[i][j] * a[i][j] * lp[i][j] for i in range(2) for j in range(len(w[i])))
    close(pg, total / 5)
    close(clipfrac, 3 / 5)  # 1.5, 0.5 and 2.0 were clipped
    close(grad, [[-1.2 / 5, 0.8 / 5, -2.2 / 5], [1.2 / 5, -0.45 / 5, 0.0]])  # -w A / 5 on every token


def test_gpg_is_the_plain_policy_gradient():
    pg, *_, grad = _loss("gpg", loss_agg_mode="seq-mean-token-sum")
    lp = [[math.log(1.5), math.log(0.5), math.log(1.1)], [math.log(2.0), math.log(0.9)]]
    row0 = -(lp[0][0] * 1 - lp[0][1] * 1 + lp[0][2] * 2)
    row1 = -(-lp[1][0] + 0.5 * lp[1][1])
    close(pg, (row0 + row1) / 2)
    close(grad, [[-0.5, 0.5, -1.0], [0.5, -0.25, 0.0]])


def test_sapo_soft_gate():
    pg, clipfrac, _, _, _ = _loss("sapo", options=PolicyLossOptions(tau_pos=1.0, tau_neg=2.0))

    def tok(r: float, a: float) -> float:
        tau = 1.0 if a > 0 else 2.0
        return -1 / (1 + math.exp(-tau * (r - 1))) * 4 / tau * a

    row0 = (tok(1.5, 1.0) + tok(0.5, -1.0) + tok(1.1, 2.0)) / 3
    row1 = (tok(2.0, -1.0) + tok(0.9, 0.5)) / 2
    close(pg, (row0 + row1) / 2)
    close(clipfrac, 0.0)


def test_geo_mean_clips_in_log_space_per_sequence():
    pg, clipfrac, _, lower, _ = _loss("geo_mean")
    # row 0: log ratios .405 (A>0: min(.405, .2) = .2), -.693 (A<0: max(-.693, -.2) = -.2), .0953 (A>0: kept)
    r0 = math.exp((0.2 - 0.2 + math.log(1.1)) / 3)
    a0 = (1.0 - 1.0 + 2.0) / 3
    # row 1: .693 with A<0 -> max(.693, .2) = .693; -.105 with A>0 -> min(-.105, -.105) = -.105
    r1 = math.exp((math.log(2.0) + math.log(0.9)) / 2)
    a1 = (-1.0 + 0.5) / 2
    close(pg, (-a0 * r0 - a1 * r1) / 2)
    # verl's counts: tokens whose log ratio leaves [-.2, .2] on either side, by the sign of A
    close(clipfrac, 1 / 5)  # .405 with A > 0
    close(lower, 2 / 5)  # -.693 and .693 with A < 0


def test_kl_cov_penalises_the_top_covariance_tokens():
    opts = PolicyLossOptions(kl_cov_ratio=0.2, ppo_kl_coef=0.5)  # 0.2 * 5 tokens = 1 token
    pg, _, ppo_kl, _, _ = _loss("kl_cov", options=opts, loss_agg_mode="token-mean")
    adv = [1.0, -1.0, 2.0, -1.0, 0.5]
    lp = [math.log(1.5), math.log(0.5), math.log(1.1), math.log(2.0), math.log(0.9)]
    ma, ml = sum(adv) / 5, sum(lp) / 5
    cov = [(a - ma) * (x - ml) for a, x in zip(adv, lp, strict=True)]
    top = max(range(5), key=lambda i: cov[i])
    ratios = [1.5, 0.5, 1.1, 2.0, 0.9]
    losses = [-a * r for a, r in zip(adv, ratios, strict=True)]
    losses[top] += 0.5 * abs(lp[top])
    close(pg, sum(losses) / 5)
    close(ppo_kl, sum(abs(x) for x in lp) / 5)


def test_clip_cov_cuts_the_gradient_of_a_chosen_unclipped_token():
    # covariance bounds wide enough that every unclipped token is a candidate; ratio 1 -> all of them
    opts = PolicyLossOptions(clip_cov_ratio=1.0, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    pg, clipfrac, *_ = _loss("clip_cov", options=opts, loss_agg_mode="token-mean")
    # PPO-clipped tokens keep max(L1, L2) and are never cut: 1.5 (A=1) -> -1.2, 0.5 (A=-1) -> 0.8.
    # The others are candidates and, with ratio 1, all cut: 1.1 (A=2), 0.9 (A=.5), and 2.0 (A=-1, whose
    # unclipped term wins, so the PPO clip is inactive there).
    close(pg, (-1.2 + 0.8) / 5)
    close(clipfrac, 3 / 5)
    # negative control: with the covariance window above every token's covariance nothing is cut
    none = PolicyLossOptions(clip_cov_ratio=1.0, clip_cov_lb=100.0, clip_cov_ub=200.0)
    pg, clipfrac, *_ = _loss("clip_cov", options=none, loss_agg_mode="token-mean")
    close(pg, (-1.2 + 0.8 + 2.0 - 2.2 - 0.45) / 5)
    close(clipfrac, 0.0)


def test_rollout_is_weights_multiply_the_token_loss():
    w = T([[2.0, 1.0, 0.5], [1.0, 1.0, 0.0]])
    plain, *_ = compute_policy_loss(OLD, NEW, ADV, MASK, loss_mode="vanilla")
    weighted, *_ = compute_policy_loss(OLD, NEW, ADV, MASK, loss_mode="vanilla", rollout_is_weights=w)
    # vanilla per-token: -1.2, 0.8, -2.2 | 2.0 (dual-clip 3 not reached), -0.45
    close(plain, (-1.2 + 0.8 - 2.2 + 2.0 - 0.45) / 5)
    close(weighted, (-2.4 + 0.8 - 1.1 + 2.0 - 0.45) / 5)


def test_every_registered_mode_runs_and_unknown_modes_name_the_key():
    assert set(POLICY_LOSSES) >= {"vanilla", "gspo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean", "sapo"}
    for mode in POLICY_LOSSES:
        pg, *_ = _loss(mode)
        assert torch.isfinite(pg), mode
    with pytest.raises(ValueError, match=r"policy_loss\.loss_mode"):
        compute_policy_loss(OLD, NEW, ADV, MASK, loss_mode="gppo")


# ---------------------------------------------------------------- rollout correction

TRAIN = T([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
ROLL = T([[-1.5, -2.0, -0.2], [-0.1, -1.0, 0.0]])  # log rho = .5, 0, -.3 | 0, -2, (padding)
RMASK = T([[1, 1, 1], [1, 1, 0]])


def test_token_and_sequence_truncated_importance_weights():
    w, m = importance_weights(TRAIN, ROLL, RMASK, "token", threshold=1.5)
    e = math.exp
    close(w, [[1.5, 1.0, e(-0.3)], [1.0, e(-2.0), 0.0]])  # e^.5 = 1.65 truncated to 1.5
    # verl reports the weights after truncation
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1.5 + 1 + e(-0.3) + 1 + e(-2)) / 5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # e^-2 < 1/1.5
    w, _ = importance_weights(TRAIN, ROLL, RMASK, "sequence", threshold=5.0)
    close(w, [[e(0.2)] * 3, [e(-2.0), e(-2.0), 0.0]])  # products of the row's ratios
    w, m = importance_weights(TRAIN, ROLL, RMASK, "token", threshold=1.5, batch_normalize=True)
    assert (w.sum() / RMASK.sum()).item() == pytest.approx(1.0)


def test_rejection_keeps_sequences_inside_the_ratio_bounds():
    # seq_sum_k1 on log(pi_rollout / pi_train): row 0 -0.2 (ratio .82), row 1 +2.0 (ratio 7.4)
    opts = parse_rs("seq_sum_k1", "0.5_2.0")
    keep, m = rejection_mask(TRAIN, ROLL, RMASK, opts)
    close(keep, [[1, 1, 1], [0, 0, 0]])
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    # token_k2 with bound 1: only the token with (log rho)^2 / 2 = 2 > 1 goes
    keep, _ = rejection_mask(TRAIN, ROLL, RMASK, parse_rs("token_k2", "1.0"))
    close(keep, [[1, 1, 1], [1, 0, 0]])
    # a single number U means 1/U .. U for k1
    assert parse_rs("token_k1", "2") == [("token_k1", 0.5, 2.0)]
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        parse_rs("seq_sum_k1,token_k2", "1,2,3")
    with pytest.raises(ValueError, match="unknown option"):
        parse_rs("seq_k9", "1")


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(TRAIN, ROLL, RMASK)
    e = math.exp
    pt = [e(-1.0), e(-2.0), e(-0.5), e(-0.1), e(-3.0)]
    pr = [e(-1.5), e(-2.0), e(-0.2), e(-0.1), e(-1.0)]
    diffs = [abs(a - b) for a, b in zip(pt, pr, strict=True)]
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(sum(diffs) / 5)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(max(diffs))
    lr = [0.5, 0.0, -0.3, 0.0, -2.0]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(lr) / 5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(e(x) - 1 - x for x in lr) / 5)
    # per sequence: mean rollout lp - mean training lp
    d0 = (-1.5 - 2.0 - 0.2) / 3 - (-1.0 - 2.0 - 0.5) / 3
    d1 = (-0.1 - 1.0) / 2 - (-0.1 - 3.0) / 2
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx((d0 + d1) / 2)
    # identical log-probs: no mismatch at all (negative control)
    same = mismatch_metrics(TRAIN, TRAIN, RMASK)
    assert same["training/rollout_probs_diff_max"] == 0.0 and same["rollout_corr/k3_kl"] == 0.0


# ---------------------------------------------------------------- DAPO


def test_groups_whose_samples_all_score_the_same_are_dropped():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    uids = ["a", "a", "b", "b", "c", "c", "d"]
    assert informative_groups(values, uids) == [False, False, True, True, False, False, True]


def test_overlong_penalty_ramps_down_over_the_buffer():
    # max 10, buffer 4: no penalty up to 6 tokens, then -(L - 6) / 4 * 2
    close(overlong_penalty(torch.tensor([3, 6, 7, 10]), 10, 4, 2.0).double(), [0.0, 0.0, -0.5, -2.0])
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(torch.tensor([1]), 10, 11, 1.0)
