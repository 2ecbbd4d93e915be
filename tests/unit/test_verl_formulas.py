"""verl's definitions, computed by hand on small examples: GSPO's aggregation, geo_mean's clip
fractions, the importance-weight metrics (token and sequence level, batch normalisation, IcePop's
bounds), the probability-difference spread, and the metric names verl's dashboards plot."""

import math
import statistics

import pytest
import torch

from megatron_rl.algos import compute_policy_loss
from megatron_rl.algos.rollout_corr import importance_weights, mismatch_metrics, parse_is_threshold
from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.run.metrics import data_metrics

e = math.exp


def T(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_gspo_aggregates_by_loss_agg_mode():
    # row 0: three tokens, log ratio .1 each -> s = e^.1 (inside [.8, 1.2]), A = +1
    # row 1: one token, log ratio -.3 -> s = e^-.3 = .741 < .8, A = -1 -> max(.741, .8) = .8 (clipped)
    old = T([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    new = T([[0.1, 0.1, 0.1], [-0.3, 5.0, 5.0]])  # the 5.0s sit on padding
    adv = T([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    row0, row1 = -e(0.1), 0.8
    pg, clipfrac, _, _ = compute_policy_loss(
        old, new, adv, mask, loss_mode="gspo", loss_agg_mode="token-mean"
    )
    assert pg.item() == pytest.approx((3 * row0 + row1) / 4)  # -0.6289: each token counts once
    assert clipfrac.item() == pytest.approx(1 / 4)
    pg, *_ = compute_policy_loss(old, new, adv, mask, loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    assert pg.item() == pytest.approx((row0 + row1) / 2)  # -0.1526: each sequence counts once


def test_geo_mean_counts_tokens_clipped_on_either_side():
    old = T([[0.0, 0.0]])
    new = T([[-0.5, 0.5]])  # both log ratios leave [-.2, .2]
    mask = T([[1, 1]])
    pg, clipfrac, _, lower = compute_policy_loss(old, new, T([[1.0, 1.0]]), mask, loss_mode="geo_mean")
    assert clipfrac.item() == pytest.approx(1.0) and lower.item() == 0.0
    # the loss clips only the side A pushes: min(delta, clip(delta)) = (-.5, .2) -> -e^mean
    assert pg.item() == pytest.approx(-e((-0.5 + 0.2) / 2))
    _, clipfrac, _, lower = compute_policy_loss(old, new, T([[-1.0, -1.0]]), mask, loss_mode="geo_mean")
    assert clipfrac.item() == 0.0 and lower.item() == pytest.approx(1.0)
    # negative control: inside the bounds nothing counts
    _, clipfrac, _, lower = compute_policy_loss(
        old, T([[-0.1, 0.1]]), T([[1.0, 1.0]]), mask, loss_mode="geo_mean"
    )
    assert clipfrac.item() == 0.0 and lower.item() == 0.0


# log rho = old - rollout: row 0 (1, .5, 0), row 1 (-.5, -1, padding)
OLD = T([[1.0, 0.5, 0.0], [-0.5, -1.0, 7.0]])
ROLL = T([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
MASK = T([[1, 1, 1], [1, 1, 0]])
RAW = [e(1.0), e(0.5), 1.0, e(-0.5), e(-1.0)]


def test_token_level_is_metrics_are_of_the_truncated_weights():
    w, m = importance_weights(OLD, ROLL, MASK, "token", 2.0)
    kept = [min(r, 2.0) for r in RAW]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(kept) / 5)  # 1.1246, not 1.2685 raw
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)  # not e = 2.718
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(e(-1.0))
    # the fractions look at the raw ratios: e > 2, e^-1 < 1/2
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)
    assert w[0].tolist() == pytest.approx([2.0, e(0.5), 1.0])


def test_sequence_level_is_fractions_per_sequence_and_normalised_by_the_sequence_mean():
    s0, s1 = e(1.5), e(-1.5)  # the rows' ratio products: 4.48 (truncated to 2) and 0.223
    w, m = importance_weights(OLD, ROLL, MASK, "sequence", 2.0)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)  # per token: 3/5
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 2)  # per token: 2/5
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(s0)  # the raw sequence ratios
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(s1)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((3 * 2.0 + 2 * s1) / 5)
    w, m = importance_weights(OLD, ROLL, MASK, "sequence", 2.0, batch_normalize=True)
    mean = (2.0 + s1) / 2  # one weight per sequence: 1.1116 (the token mean would be 1.2893)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert w[0, 0].item() == pytest.approx(2.0 / mean)  # 1.799 (1.551 with the token mean)
    assert w[1, :2].tolist() == pytest.approx([s1 / mean] * 2) and w[1, 2].item() == 0.0
    # token level normalises by the token mean
    w, m = importance_weights(OLD, ROLL, MASK, "token", 2.0, batch_normalize=True)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(sum(min(r, 2.0) for r in RAW) / 5)


def test_icepop_bounds_zero_the_weights_outside():
    assert parse_is_threshold("0.5_2.0") == (0.5, 2.0) and parse_is_threshold(2) == (None, 2.0)
    w, m = importance_weights(OLD, ROLL, MASK, "token", "0.5_2.0")
    assert w[0].tolist() == pytest.approx([0.0, e(0.5), 1.0])  # e > 2: zeroed
    assert w[1].tolist() == pytest.approx([e(-0.5), 0.0, 0.0])  # e^-1 < .5: zeroed
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((e(0.5) + 1 + e(-0.5)) / 5)
    for bad in ("2.0_0.5", "0_2", "x", True):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            parse_is_threshold(bad)


def test_rollout_probs_diff_std_divides_by_n_minus_1():
    p_train, p_roll = [0.5, 0.4, 0.9, 0.2], [0.45, 0.5, 0.9, 0.35]
    old = torch.log(T([p_train]))
    roll = torch.log(T([p_roll]))
    m = mismatch_metrics(old, roll, T([[1, 1, 1, 1]]))
    diffs = [abs(a - b) for a, b in zip(p_train, p_roll, strict=True)]
    assert m["training/rollout_probs_diff_std"] == pytest.approx(statistics.stdev(diffs))  # torch.std
    assert m["training/rollout_probs_diff_std"] != pytest.approx(statistics.pstdev(diffs))


def test_data_metrics_carry_verl_dashboard_names():
    prompts = torch.tensor([[5, 6], [7, 8], [7, 8]])
    responses = torch.tensor([[3, 4], [3, 0], [0, 0]])
    response_mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # lengths 2, 1 and 0 (aborted)
    b = RolloutBatch.from_tokens(
        prompts, torch.ones_like(prompts), responses, response_mask, [SeqMeta(x) for x in "abc"]
    )
    b.token_level_scores = b.token_level_rewards = torch.zeros(3, 2)
    b.advantages = b.returns = torch.zeros(3, 2)
    m = data_metrics(b, max_prompt_length=2, max_response_length=2, dp_group=None)
    assert m["response_length/mean"] == pytest.approx(1.0)
    assert m["response_length_non_aborted/mean"] == pytest.approx(1.5)  # the empty response left out
    assert m["response_length_non_aborted/min"] == 1.0
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(1 / 2)
    assert m["training/num_turns/mean"] == m["training/num_turns/max"] == 1.0
    # multi-turn episodes: the turns their extra_info carries (as multi_turn/num_turns/*), 1 for the others
    b.meta[0].extra_info, b.meta[1].extra_info = {"num_turns": 4}, {"num_turns": 3}
    m = data_metrics(b, max_prompt_length=2, max_response_length=2, dp_group=None)
    assert m["training/num_turns/mean"] == pytest.approx(8 / 3)
    assert (m["training/num_turns/max"], m["training/num_turns/min"]) == (4.0, 1.0)
