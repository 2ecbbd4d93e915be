"""Unit tests for megatron_rl.algos against hand-computed numbers on tiny tensors."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megatron_rl.algos import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_gae,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    get_adv_estimator,
    get_kl_controller,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
)
from tests.conftest import run_forked_ranks


def T(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_var_whiten():
    x = T([[1.0, 2.0, 100.0], [3.0, 6.0, -50.0]])
    mask = T([[1, 1, 0], [1, 1, 0]])
    # valid: 1, 2, 3, 6 -> mean 12/4 = 3
    close(masked_mean(x, mask), 3.0)
    # per row: (1+2)/2 = 1.5, (3+6)/2 = 4.5
    close(masked_mean(x, mask, dim=-1), [1.5, 4.5])
    # squared deviations 4, 1, 0, 9 -> 14; unbiased 14/3, biased 14/4
    close(masked_var(x, mask), 14 / 3)
    close(masked_var(x, mask, unbiased=False), 3.5)
    # whiten: (x - 3) / sqrt(14/3); sqrt(14/3) = 2.160247
    w = masked_whiten(x, mask)
    close(w[mask.bool()], [-2 / 2.160247, -1 / 2.160247, 0.0, 3 / 2.160247])
    # shift_mean=False adds the mean back: (x - 3)/2.160247 + 3
    w2 = masked_whiten(x, mask, shift_mean=False)
    close(w2[0, 0], -2 / 2.160247 + 3)
    # all-padding mean is 0, not NaN
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)
    with pytest.raises(ValueError):
        masked_var(x, T([[1, 0, 0], [0, 0, 0]]))


# ---------------------------------------------------------------- GAE


def _gae_inputs(pad_reward: float, pad_value: float):
    # row 0: 3 real tokens; row 1: 2 real tokens and one padding position with garbage reward/value.
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, pad_reward]])
    values = T([[0.5, 0.6, 0.7], [1.0, 0.5, pad_value]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    return rewards, values, mask


def test_gae_hand_computed_with_padding():
    rewards, values, mask = _gae_inputs(pad_reward=5.0, pad_value=9.0)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # gamma * lam = 0.45
    # row 0: t2: delta = 1 + 0.9*0 - 0.7 = 0.3                 A2 = 0.3
    #        t1: delta = 0 + 0.9*0.7 - 0.6 = 0.03              A1 = 0.03 + 0.45*0.3 = 0.165
    #        t0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A0 = 0.04 + 0.45*0.165 = 0.11425
    # row 1: t2 padding: state stays (next value 0, gae 0)    A2 = 0
    #        t1: delta = 2 + 0.9*0 - 0.5 = 1.5                 A1 = 1.5
    #        t0: delta = 0 + 0.9*0.5 - 1.0 = -0.55             A0 = -0.55 + 0.45*1.5 = 0.125
    # returns = A + V (before whitening)
    close(ret[0], [0.11425 + 0.5, 0.165 + 0.6, 0.3 + 0.7])
    close(ret[1, :2], [0.125 + 1.0, 1.5 + 0.5])
    # whitening over the 5 real tokens: sum = 2.20425, mean = 0.44085,
    # squared deviations: 0.10666756 + 0.0760932225 + 0.0198387225 + 0.0997612225 + 1.1217987225
    #   = 1.42415945, unbiased var = 1.42415945 / 4 = 0.3560398625
    std = math.sqrt(0.3560398625)
    raw = T([[0.11425, 0.165, 0.3], [0.125, 1.5, 0.44085]])
    expected = (raw - 0.44085) / std * mask
    close(adv, expected)
    assert adv[1, 2] == 0.0

    # Garbage at the padding position must not reach any real token.
    adv2, ret2 = compute_gae(*_gae_inputs(pad_reward=-100.0, pad_value=42.0), gamma=0.9, lam=0.5)
    close(adv2, adv)
    close(ret2 * mask, ret * mask)


# ---------------------------------------------------------------- outcome estimators


def _outcome_inputs():
    # One reward per sequence at its last real token; rows have 2, 3, 1, 3, 2, 1 real tokens.
    # scores: group a -> 1, 0, 2; group b -> 3; group c -> 1, 4
    mask = T([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    rewards = T([[0, 1, 0], [0, 0, 0], [2, 0, 0], [0, 0, 3], [0, 1, 0], [4, 0, 0]])
    index = ["a", "a", "a", "b", "c", "c"]
    return rewards, mask, index


def test_grpo_std_normalised():
    rewards, mask, index = _outcome_inputs()
    eps = 1e-6
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=True, epsilon=eps)
    # a: mean 1, deviations 0,-1,1, unbiased var 2/2 = 1, std 1 -> 0, -1/(1+eps), 1/(1+eps)
    # b: single sample -> mean 0, std 1 -> 3/(1+eps)
    # c: mean 2.5, deviations -1.5, 1.5, var 4.5/1 = 4.5, std 2.1213203 -> -/+ 1.5/2.1213203 = -/+ 0.7071065
    per_seq = [0.0, -1 / (1 + eps), 1 / (1 + eps), 3 / (1 + eps), -0.7071065, 0.7071065]
    close(adv, T(per_seq).unsqueeze(-1) * mask)
    assert torch.equal(adv, ret)


def test_grpo_without_std_and_constant_group():
    rewards, mask, index = _outcome_inputs()
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    # a: 1-1, 0-1, 2-1; b: 3-0; c: 1-2.5, 4-2.5
    close(adv, T([0, -1, 1, 3, -1.5, 1.5]).unsqueeze(-1) * mask)

    # A group whose scores are all equal has std 0: (s - mean) / (0 + eps) = 0, not NaN.
    adv, _ = compute_grpo_outcome_advantage(T([[1.0], [1.0]]), T([[1], [1]]), [7, 7])
    close(adv, [[0.0], [0.0]])


def test_rloo():
    rewards, mask, index = _outcome_inputs()
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, index)
    # a: 1 - (0+2)/2 = 0;  0 - (1+2)/2 = -1.5;  2 - (1+0)/2 = 1.5
    # b: single sample keeps its score 3
    # c: 1 - 4 = -3; 4 - 1 = 3
    close(adv, T([0, -1.5, 1.5, 3, -3, 3]).unsqueeze(-1) * mask)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_discount_and_reset():
    rewards = T([[1.0, 0.0, 2.0], [0.0, 3.0, 7.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    # row 1: the 7 sits on padding and is dropped after it: G1 = 3, G0 = 0 + 0.5*3 = 1.5
    close(ret[0], [1.5, 1.0, 2.0])
    close(ret[1, :2], [1.5, 3.0])
    # whiten over 1.5, 1, 2, 1.5, 3: mean 9/5 = 1.8; squared deviations .09+.64+.04+.09+1.44 = 2.3;
    # unbiased var 2.3/4 = 0.575
    std = math.sqrt(0.575)
    close(adv, (T([[1.5, 1.0, 2.0], [1.5, 3.0, 1.8]]) - 1.8) / std * mask)


def test_reinforce_plus_plus_baseline():
    rewards = T([[0, 1, 0], [3, 0, 0], [0, 0, 5]])
    mask = T([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "b"])
    # scores 1, 3 (group a, mean 2) and 5 (group b alone, mean 0) -> -1, 1, 5
    # tokens: -1, -1 | 1 | 5, 5, 5 -> sum 14, mean 7/3
    # squared deviations: 2*(10/3)^2 + (4/3)^2 + 3*(8/3)^2 = (200 + 16 + 192)/9 = 408/9; unbiased /5
    mean, std = 7 / 3, math.sqrt(408 / 45)
    close(adv, (T([[-1, -1, 0], [1, 0, 0], [5, 5, 5]]) - mean) / std * mask)
    assert torch.equal(adv, ret)


def test_adv_estimator_registry():
    assert get_adv_estimator("gae") is compute_gae
    assert get_adv_estimator("grpo") is compute_grpo_outcome_advantage
    assert get_adv_estimator("rloo") is compute_rloo_outcome_advantage
    assert get_adv_estimator("reinforce_plus_plus") is compute_reinforce_plus_plus_outcome_advantage
    assert (
        get_adv_estimator("reinforce_plus_plus_baseline")
        is compute_reinforce_plus_plus_baseline_outcome_advantage
    )
    assert get_adv_estimator("gpg") is compute_gpg_outcome_advantage
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator.*gae.*grpo"):
        get_adv_estimator("remax_typo")


# ---------------------------------------------------------------- KL


def test_kl_estimators():
    logp = T([-1.0, -2.0])
    ref = T([-2.0, -1.5])
    # logp - ref = 1, -0.5
    close(kl_penalty(logp, ref, "kl"), [1.0, -0.5])
    close(kl_penalty(logp, ref, "k1"), [1.0, -0.5])
    close(kl_penalty(logp, ref, "abs"), [1.0, 0.5])
    # 0.5 * 1^2, 0.5 * 0.25
    close(kl_penalty(logp, ref, "mse"), [0.5, 0.125])
    close(kl_penalty(logp, ref, "k2"), [0.5, 0.125])
    # ref - logp = -1, 0.5: exp(-1) + 1 - 1 = 0.3678794; exp(0.5) - 0.5 - 1 = 1.6487213 - 1.5 = 0.1487213
    close(kl_penalty(logp, ref, "low_var_kl"), [0.3678794, 0.1487213])
    close(kl_penalty(logp, ref, "k3"), [0.3678794, 0.1487213])
    # ref - logp = 30 is clamped to 20 before exp, and exp(20) - 21 is clamped to 10
    close(kl_penalty(T([-30.0]), T([0.0]), "k3"), [10.0])
    with pytest.raises(ValueError, match=r"algorithm\.kl_penalty.*actor_rollout_ref\.actor\.kl_loss_type"):
        kl_penalty(logp, ref, "full")


def test_kl_controllers():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    # error = 0.1/0.05 - 1 = 1, clipped to 0.2; mult = 1 + 0.2 * 10/100 = 1.02 -> 0.102
    ctrl.update(current_kl=0.1, n_steps=10)
    assert ctrl.value == pytest.approx(0.102)
    # error = 0.045/0.05 - 1 = -0.1; mult = 1 - 0.1 * 50/100 = 0.95 -> 0.102 * 0.95 = 0.0969
    ctrl.update(current_kl=0.045, n_steps=50)
    assert ctrl.value == pytest.approx(0.0969)

    resumed = get_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == pytest.approx(0.0969)

    fixed = get_kl_controller("fixed", kl_coef=0.3)
    assert isinstance(fixed, FixedKLController)
    fixed.update(current_kl=10.0, n_steps=1000)
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match=r"algorithm\.kl_ctrl\.type"):
        get_kl_controller("pid", kl_coef=0.1)


def test_apply_kl_penalty():
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = T([[0.1, 0.2, 0.3], [0.4, 0.2, 5.0]])
    ref = torch.zeros_like(old)
    mask = T([[1, 1, 1], [1, 1, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.5, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    # rewards = scores - 0.5 * kl * mask (padding KL 5.0 ignored)
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.9, 0.0]])
    # per-sequence mean KL: 0.6/3 = 0.2, 0.6/2 = 0.3 -> batch mean 0.25 (token mean would be 1.2/5 = 0.24)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.25)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # update(0.25, n_steps=2): error = 0.25/0.5 - 1 = -0.5 -> -0.2; mult = 1 - 0.2*2/10 = 0.96 -> 0.48
    assert ctrl.value == pytest.approx(0.48)


# ---------------------------------------------------------------- losses

LOSS_MAT = T([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
LOSS_MASK = T([[1, 1, 0], [1, 1, 1], [0, 0, 0]])  # the last row is all padding


def test_agg_loss_modes():
    # token-mean: (1+2 + 4+5+6) / 5 = 3.6
    close(agg_loss(LOSS_MAT, LOSS_MASK, "token-mean"), 3.6)
    # seq-mean-token-sum: sums 3, 15; the empty row is not a sequence -> 18/2 = 9
    close(agg_loss(LOSS_MAT, LOSS_MASK, "seq-mean-token-sum"), 9.0)
    # seq-mean-token-mean: means 1.5, 5 -> 3.25
    close(agg_loss(LOSS_MAT, LOSS_MASK, "seq-mean-token-mean"), 3.25)
    # token-sum: 18, no normalisation
    close(agg_loss(LOSS_MAT, LOSS_MASK, "token-sum"), 18.0)
    # seq-mean-token-sum-norm: (3 + 15) / 2 sequences / the constant 4 (or the width 3 when not given)
    close(agg_loss(LOSS_MAT, LOSS_MASK, "seq-mean-token-sum-norm", loss_scale_factor=4), 9.0 / 4)
    close(agg_loss(LOSS_MAT, LOSS_MASK, "seq-mean-token-sum-norm"), 9.0 / 3)
    zero_mask = torch.zeros_like(LOSS_MASK)
    for mode in (
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ):
        out = agg_loss(LOSS_MAT, zero_mask, mode)
        assert out.item() == 0.0, mode
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.loss_agg_mode"):
        agg_loss(LOSS_MAT, LOSS_MASK, "token-average")


def test_agg_loss_no_nan_gradient_from_padding_row():
    loss_mat = LOSS_MAT.clone().requires_grad_(True)
    agg_loss(loss_mat, LOSS_MASK, "seq-mean-token-mean").backward()
    assert torch.isfinite(loss_mat.grad).all()
    # d/dx of (mean(row0) + mean(row1)) / 2: 1/4 on row 0, 1/6 on row 1, 0 on padding
    close(loss_mat.grad, [[0.25, 0.25, 0], [1 / 6, 1 / 6, 1 / 6], [0, 0, 0]])


def test_global_denominator_micro_batches_sum_to_full_batch():
    full_mat = torch.cat([LOSS_MAT, T([[10, 0, 0]])])
    full_mask = torch.cat([LOSS_MASK, T([[1, 0, 0]])])
    # full batch: 6 tokens, 3 non-empty sequences
    #   token-mean 28/6, seq-mean-token-sum (3+15+10)/3 = 28/3, seq-mean-token-mean (1.5+5+10)/3 = 5.5
    expected = {"token-mean": 28 / 6, "seq-mean-token-sum": 28 / 3, "seq-mean-token-mean": 5.5}
    denominators = {"token-mean": 6, "seq-mean-token-sum": 3, "seq-mean-token-mean": 3}
    for mode, value in expected.items():
        close(agg_loss(full_mat, full_mask, mode), value)
        parts = [
            agg_loss(full_mat[:2], full_mask[:2], mode, global_denominator=denominators[mode]),
            agg_loss(full_mat[2:], full_mask[2:], mode, global_denominator=torch.tensor(denominators[mode])),
        ]
        close(parts[0] + parts[1], value)
    # Without it the local means do not add up: 3.6 + 10 != 28/6
    assert agg_loss(full_mat[:2], full_mask[:2], "token-mean") + agg_loss(
        full_mat[2:], full_mask[2:], "token-mean"
    ) == pytest.approx(13.6)


def test_global_denominator_gradients_match_full_batch():
    old = T([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0], [-0.7, -0.9, -1.1], [-2.0, -1.0, -0.3]])
    new = old + T([[0.1, -0.3, 0.5], [0.0, 0.2, -0.1], [0.3, 0.3, 0.3], [-0.4, 0.1, 0.0]])
    adv = T([[1.0, -1.0, 0.5], [2.0, -0.5, 1.0], [-1.0, 1.0, 0.0], [0.3, 0.3, 0.3]])
    mask = T([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    n_tokens = int(mask.sum())

    full = new.clone().requires_grad_(True)
    compute_policy_loss(old, full, adv, mask)[0].backward()

    micro = new.clone().requires_grad_(True)
    total = sum(
        compute_policy_loss(old[s], micro[s], adv[s], mask[s], global_denominator=n_tokens)[0]
        for s in (slice(0, 1), slice(1, 4))
    )
    total.backward()
    close(micro.grad, full.grad)


def test_policy_loss_clip_positive_advantage():
    old = T([[0.0, 0.0]])
    new = torch.log(T([[1.5, 1.1]]))  # ratios 1.5 and 1.1
    adv = T([[1.0, 1.0]])
    mask = T([[1, 1]])
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, adv, mask, clip_ratio=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-1.1, -1.1) = -1.1 (not clipped)
    close(pg_loss, (-1.2 - 1.1) / 2)
    close(clipfrac, 0.5)
    close(clipfrac_lower, 0.0)
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 1.1)/2 = -(0.4054651 + 0.0953102)/2
    close(ppo_kl, -0.25038765)


def test_policy_loss_dual_clip_negative_advantage():
    old = T([[0.0, 0.0, 0.0]])
    new = torch.log(T([[5.0, 0.5, 2.0]]))
    adv = T([[-1.0, -1.0, -1.0]])
    mask = T([[1, 1, 1]])
    pg_loss, clipfrac, _, clipfrac_lower = compute_policy_loss(old, new, adv, mask, clip_ratio_c=3.0)
    # token 0, ratio 5: max(5, 1.2) = 5, dual-clip min(5, 3) = 3 -> counted in clipfrac_lower
    # token 1, ratio 0.5: max(0.5, 0.8) = 0.8 (clipped: counted in clipfrac), min(0.8, 3) = 0.8
    # token 2, ratio 2: max(2, 1.2) = 2, min(2, 3) = 2
    close(pg_loss, (3.0 + 0.8 + 2.0) / 3)
    close(clipfrac, 1 / 3)
    close(clipfrac_lower, 1 / 3)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.clip_ratio_c"):
        compute_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)


def test_policy_loss_clip_higher_asymmetry():
    old = T([[0.0, 0.0]])
    new = torch.log(T([[1.25, 0.75]]))
    adv = T([[1.0, -1.0]])
    mask = T([[1, 1]])
    # symmetric 0.2: token 0 max(-1.25, -1.2) = -1.2 clipped; token 1 max(0.75, 0.8) = 0.8 clipped
    loss, clipfrac, _, _ = compute_policy_loss(old, new, adv, mask, clip_ratio=0.2)
    close(loss, (-1.2 + 0.8) / 2)
    close(clipfrac, 1.0)
    # clip-higher (low 0.2, high 0.28): 1.25 < 1.28 is no longer clipped: -1.25; token 1 still 0.8
    loss, clipfrac, _, _ = compute_policy_loss(
        old, new, adv, mask, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    close(loss, (-1.25 + 0.8) / 2)
    close(clipfrac, 0.5)


def test_policy_loss_extreme_log_ratio_is_finite():
    old = T([[0.0, -1000.0]])
    new = T([[-1000.0, 0.0]])
    loss, *_ = compute_policy_loss(old, new, T([[1.0, 1.0]]), T([[1, 1]]))
    assert torch.isfinite(loss)


def test_value_loss_clipping():
    vpreds = T([[1.5, 0.9, 100.0]])
    values = T([[1.0, 1.0, 0.0]])
    returns = T([[2.0, 0.0, 0.0]])
    mask = T([[1, 1, 0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.2)
    # token 0: clip(1.5, 0.8, 1.2) = 1.2; (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64 -> 0.64 (clipped)
    # token 1: clip(0.9, 0.8, 1.2) = 0.9; both 0.81 -> 0.81 (not clipped)
    # 0.5 * (0.64 + 0.81) / 2 = 0.3625; the padding token's huge error is ignored
    close(vf_loss, 0.3625)
    close(vf_clipfrac, 0.5)


# ---------------------------------------------------------------- process-group whitening

RANK_DATA = {
    # rank -> (x, mask); shapes and token counts differ between ranks
    0: (T([[1.0, 2.0, 3.0], [4.0, 5.0, -9.0]]), T([[1, 1, 1], [1, 1, 0]])),
    1: (T([[10.0, 7.0]]), T([[1, 0]])),
}
GAE_DATA = {
    0: (
        T([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]]),
        T([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]]),
        T([[1, 1, 1], [1, 1, 0]]),
    ),
    1: (T([[0.0, 3.0, 0.0]]), T([[0.2, 0.1, 0.0]]), T([[1, 1, 0]])),
}


def _dist_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    x, mask = RANK_DATA[rank]
    whitened = masked_whiten(x, mask, group=group)
    rewards, values, gmask = GAE_DATA[rank]
    adv, _ = compute_gae(rewards, values, gmask, gamma=0.9, lam=0.5, group=group)
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.5, horizon=10)
    _, metrics = apply_kl_penalty(rewards, values, torch.zeros_like(values), gmask, ctrl, "kl", group=group)
    torch.save(
        {"whitened": whitened, "gae": adv, "kl": metrics["actor/reward_kl_penalty"], "coef": ctrl.value},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_whitening_across_process_group(tmp_path):
    run_forked_ranks(_dist_worker, tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

    # Whitening each rank's part against the group equals whitening the concatenation of the valid
    # tokens (1, 2, 3, 4, 5 from rank 0 and 10 from rank 1) in one process.
    valid = torch.cat([RANK_DATA[r][0][RANK_DATA[r][1].bool()] for r in (0, 1)])
    reference = masked_whiten(valid, torch.ones_like(valid))
    close(results[0]["whitened"][RANK_DATA[0][1].bool()], reference[:5])
    close(results[1]["whitened"][RANK_DATA[1][1].bool()], reference[5:])

    # GAE is per row, so stacking both ranks' rows in one batch gives the group result.
    stacked = [torch.cat([GAE_DATA[0][i], GAE_DATA[1][i]]) for i in range(3)]
    ref_adv, _ = compute_gae(*stacked, gamma=0.9, lam=0.5)
    close(torch.cat([results[0]["gae"], results[1]["gae"]]), ref_adv)

    # The KL metric and the adaptive coefficient are global and identical on both ranks.
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.5, horizon=10)
    _, metrics = apply_kl_penalty(
        stacked[0], stacked[1], torch.zeros_like(stacked[1]), stacked[2], ctrl, "kl"
    )
    for res in results:
        assert res["kl"] == pytest.approx(metrics["actor/reward_kl_penalty"])
        assert res["coef"] == pytest.approx(ctrl.value)
