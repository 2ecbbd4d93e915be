"""verl's algorithm variants against numbers worked out by hand in each test: REINFORCE++ across mask
zeros, GPG's advantage, straight-through KL, the policy-loss modes (DPPO-TV among them), rollout
importance weights and rejection, the mismatch metrics, DAPO's group filter and overlong shaping."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import (
    POLICY_LOSSES,
    PolicyLossOptions,
    compute_gpg_outcome_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_outcome_advantage,
    effective_agg_mode,
    kl_penalty,
)
from megatron_rl.algos import advantages as advantages_module
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


# ---------------------------------------------------------------- GPG advantage

# Rewards at each row's last real token; the 9s sit on padding. Groups: a (3 rows), b (1), c (2), d (2).
# scores: a -> 1, 0, 2; b -> 3; c -> 1, 4; d -> 1, 1 (all equal: advantage 0 but score nonzero)
GPG_REWARDS = T([[0, 1, 9], [0, 0, 0], [2, 9, 9], [0, 0, 3], [0, 1, 9], [4, 9, 9], [0, 1, 9], [1, 9, 9]])
GPG_MASK = T([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
GPG_INDEX = ["a", "a", "a", "b", "c", "c", "d", "d"]


def _gpg_reference(rewards: torch.Tensor, mask: torch.Tensor, index: list) -> torch.Tensor:
    """verl's compute_gpg_outcome_advantage as plain loops: score = sum of the sequence's rewards,
    alpha = B / max(1, #nonzero scores) over the batch, mean 0 for a lone sample, no std division.
    verl sums the whole row; its rewards are 0 past the response, so the sum over real tokens is the
    same there, and rewards left on padding (the 9s) are ignored here, as grpo/rloo ignore them."""
    r, m = rewards.tolist(), mask.tolist()
    scores = [sum(x * k for x, k in zip(row, keep, strict=True)) for row, keep in zip(r, m, strict=True)]
    alpha = len(scores) / max(1, sum(1 for x in scores if x != 0))
    members: dict = {}
    for i, uid in enumerate(index):
        members.setdefault(uid, []).append(scores[i])
    out = []
    for i, uid in enumerate(index):
        group = members[uid]
        mean = 0.0 if len(group) == 1 else sum(group) / len(group)
        out.append([alpha * (scores[i] - mean) * k for k in m[i]])
    return T(out)


def test_gpg_advantage_scales_the_group_baseline_by_the_nonzero_score_share():
    """verl's compute_gpg_outcome_advantage on groups of 3, 1, 2 and 2 samples, with padding."""
    adv, ret = compute_gpg_outcome_advantage(GPG_REWARDS, GPG_MASK, GPG_INDEX)
    # 8 sequences, 7 with a nonzero score (only a's second scores 0): alpha = 8/7.
    # a: mean 1 -> 0, -1, 1; b alone keeps 3; c: mean 2.5 -> -1.5, 1.5; d: mean 1 -> 0, 0
    alpha = 8 / 7
    per_seq = [alpha * x for x in [0, -1, 1, 3, -1.5, 1.5, 0, 0]]
    close(adv, T(per_seq).unsqueeze(-1) * GPG_MASK)
    close(adv, _gpg_reference(GPG_REWARDS, GPG_MASK, GPG_INDEX))
    assert torch.equal(adv, ret)
    # negative controls: alpha counts nonzero scores, not nonzero advantages (5 of them: 8/5), and it is
    # not 1 (that is GRPO without the std division)
    for wrong_alpha in (8 / 5, 1.0):
        assert not torch.allclose(adv, T([wrong_alpha * x / alpha for x in per_seq]).unsqueeze(-1) * GPG_MASK)


def test_gpg_advantage_edge_cases():
    """verl's compute_gpg_outcome_advantage: the all-zero batch and a group whose std would matter."""
    # every score 0: alpha = B / 1, advantages 0, no division by zero
    adv, _ = compute_gpg_outcome_advantage(torch.zeros(3, 2, dtype=torch.float64), T([[1, 1]] * 3), [0, 0, 1])
    close(adv, [[0, 0]] * 3)
    # one group, one zero score out of 4: alpha = 4/3; mean 1.5 -> -1.5, -.5, .5, 1.5 (std 1.29 not used)
    adv, _ = compute_gpg_outcome_advantage(T([[0.0], [1.0], [2.0], [3.0]]), T([[1]] * 4), ["p"] * 4)
    close(adv, [[-2.0], [-2 / 3], [2 / 3], [2.0]])


def test_gpg_alpha_is_taken_over_every_rank(monkeypatch):
    """verl's compute_gpg_outcome_advantage counts alpha on the driver's whole batch; split over
    data-parallel ranks the counts are summed, so each rank gets the whole batch's alpha."""
    # Rank 0 holds groups a, b (rows 0-3), rank 1 groups c, d (rows 4-7). The fake all-reduce adds
    # rank 1's [sequences, nonzero scores] = [4, 4] to rank 0's [4, 3], as a two-rank SUM would.
    full, _ = compute_gpg_outcome_advantage(GPG_REWARDS, GPG_MASK, GPG_INDEX)
    other = T([4.0, 4.0])
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(group)
        t += other.to(t.dtype)

    def fake_all_gather_object(out, obj, group=None):  # the groups' uids: none spans the two ranks
        out[:] = [obj, (list(GPG_INDEX[4:]), torch.zeros(4))]

    monkeypatch.setattr(advantages_module.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(advantages_module.dist, "all_gather_object", fake_all_gather_object)
    monkeypatch.setattr(advantages_module.dist, "get_world_size", lambda group=None: 2)
    rank0, _ = compute_gpg_outcome_advantage(GPG_REWARDS[:4], GPG_MASK[:4], GPG_INDEX[:4], group="dp")
    assert calls == ["dp"]
    close(rank0, full[:4])  # alpha 8/7, as on the whole batch
    # negative control: on the rank's rows alone alpha would be 4/3
    local, _ = compute_gpg_outcome_advantage(GPG_REWARDS[:4], GPG_MASK[:4], GPG_INDEX[:4])
    close(local, full[:4] * (4 / 3) / (8 / 7))
    assert not torch.allclose(local, full[:4])


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


# ---------------------------------------------------------------- DPPO-Binary-TV

# Probabilities of the sampled tokens (old -> new) and their advantages; row 0 has 4 real tokens,
# row 1 has 3. With clip_ratio 0.2 and clip_ratio_c 3:
#   row 0: A=+1 .5 -> .6 (p moves +.1: kept, r 1.2) | A=+1 .1 -> .6 (+.5 > .2: dropped, r 6)
#          A=+2 .001 -> .01 (+.009: kept; r 10 > 3: weight 3) | A=+1 .9 -> .4 (-.5: only the upper side
#          binds for A > 0, kept, r .444) | padding
#   row 1: A=-1 .5 -> .25 (-.25 < -.2: dropped) | A=-.5 .2 -> .9 (+.7: kept, r 4.5 > 3: weight 3)
#          A=0 .8 -> .5 (-.3: A = 0 takes the lower side, dropped) | padding | padding
DPPO_P_OLD = [[0.5, 0.1, 0.001, 0.9, 0.7], [0.5, 0.2, 0.8, 0.6, 0.6]]
DPPO_P_NEW = [[0.6, 0.6, 0.01, 0.4, 0.1], [0.25, 0.9, 0.5, 0.05, 0.9]]
DPPO_ADV = T([[1.0, 1.0, 2.0, 1.0, 5.0], [-1.0, -0.5, 0.0, 3.0, -4.0]])
DPPO_MASK = T([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])


def _dppo_reference(low: float, high: float, c: float) -> dict:
    """verl's compute_policy_loss_dppo_tv per token, as plain loops: weight min(r, c) (no gradient),
    keep = (p - p_old <= high) if A > 0 else (p - p_old >= -low), loss -A weight log p keep;
    pg_clipfrac = share of masked-in tokens with keep 0, pg_clipfrac_lower = share with keep 1 and r > c."""
    loss, grad, dropped, truncated = [], [], 0, 0
    n = int(DPPO_MASK.sum().item())
    for i in range(2):
        loss.append([])
        grad.append([])
        for j in range(5):
            po, pn, a = DPPO_P_OLD[i][j], DPPO_P_NEW[i][j], DPPO_ADV[i][j].item()
            m = DPPO_MASK[i][j].item()
            r = pn / po
            w = min(r, c)
            keep = (pn - po <= high) if a > 0 else (pn - po >= -low)
            loss[i].append(-a * w * math.log(pn) * keep * m)
            grad[i].append(-a * w * keep * m)  # d/dlog p of the token's loss, before the 1/n
            dropped += m * (not keep)
            truncated += m * keep * (r > c)
    return {"loss": loss, "grad": grad, "clipfrac": dropped / n, "lower": truncated / n, "n": n}


def _dppo(**kw) -> tuple[torch.Tensor, ...]:
    new = torch.log(T(DPPO_P_NEW)).requires_grad_(True)
    out = compute_policy_loss(torch.log(T(DPPO_P_OLD)), new, DPPO_ADV, DPPO_MASK, loss_mode="dppo_tv", **kw)
    out[0].backward()
    return (*out, new.grad)


def test_dppo_tv_by_hand():
    """verl's compute_policy_loss_dppo_tv (DPPO-Binary-TV) at clip_ratio 0.2, clip_ratio_c 3: loss,
    gradient, pg_clipfrac, pg_clipfrac_lower and ppo_kl, by hand and against the loop reference."""
    pg, clipfrac, ppo_kl, lower, grad = _dppo(clip_ratio=0.2, clip_ratio_c=3.0)
    lp = math.log
    # kept tokens: row 0 -> 1.2 log .6, 3 * 2 log .01 (weight capped), .4/.9 log .4; row 1 -> A=-.5, weight 3
    tokens = [-1.2 * lp(0.6), -2.0 * 3.0 * lp(0.01), -(0.4 / 0.9) * lp(0.4), 0.5 * 3.0 * lp(0.9)]
    close(pg, sum(tokens) / 7)
    # gradient -A min(r, 3) / 7 on kept tokens; dropped tokens, A = 0 and padding get none
    close(grad, [[-1.2 / 7, 0, -6 / 7, -(0.4 / 0.9) / 7, 0], [0, 1.5 / 7, 0, 0, 0]])
    close(clipfrac, 3 / 7)  # .1 -> .6 (A > 0), .5 -> .25 (A < 0), .8 -> .5 (A = 0)
    close(lower, 2 / 7)  # r = 10 and r = 4.5, both kept; r = 6 is dropped and not counted
    log_r = [[lp(1.2), lp(6.0), lp(10.0), lp(0.4 / 0.9)], [lp(0.5), lp(4.5), lp(0.5 / 0.8)]]
    close(ppo_kl, -sum(sum(row) for row in log_r) / 7)
    ref = _dppo_reference(0.2, 0.2, 3.0)
    close(pg, sum(map(sum, ref["loss"])) / ref["n"])
    close(grad, T(ref["grad"]) / ref["n"])
    # negative control: PPO's ratio clip cuts the rare token's gradient (r = 10), the TV bound keeps it
    new = torch.log(T(DPPO_P_NEW)).requires_grad_(True)
    compute_policy_loss(torch.log(T(DPPO_P_OLD)), new, DPPO_ADV, DPPO_MASK, clip_ratio=0.2)[0].backward()
    assert new.grad[0, 2] == 0 and grad[0, 2] != 0
    # the loss is -A w log p, not the surrogate -A w: their values differ
    assert not torch.isclose(pg, T(-(1.2 + 6.0 + 0.4 / 0.9 - 1.5) / 7))


def test_dppo_tv_asymmetric_bounds_and_no_truncation():
    """verl's compute_policy_loss_dppo_tv with clip_ratio_low != clip_ratio_high and verl's example
    clip_ratio_c=1e4 (no truncation)."""
    # high .55 keeps .1 -> .6 (+.5); low .26 keeps .5 -> .25 (-.25) but not .8 -> .5 (-.3); c large
    pg, clipfrac, _, lower, grad = _dppo(
        clip_ratio=0.2, clip_ratio_low=0.26, clip_ratio_high=0.55, clip_ratio_c=1e4
    )
    ref = _dppo_reference(0.26, 0.55, 1e4)
    close(pg, sum(map(sum, ref["loss"])) / 7)
    close(grad, T(ref["grad"]) / 7)
    close(grad[0, 1], -6.0 / 7)  # r = 6 with A = +1, now inside the bound
    close(grad[0, 2], -20.0 / 7)  # r = 10 untruncated, A = 2
    close(grad[1, 0], 0.5 / 7)  # r = .5 with A = -1, now inside the bound
    close(clipfrac, 1 / 7)
    close(lower, 0.0)


def test_dppo_tv_aggregation_and_rollout_weights():
    """verl's compute_policy_loss_dppo_tv aggregates by loss_agg_mode and multiplies the per-token loss
    by the rollout importance weights before aggregating."""
    ref = _dppo_reference(0.2, 0.2, 3.0)
    seq_means = [sum(ref["loss"][0]) / 4, sum(ref["loss"][1]) / 3]
    pg, *_ = _dppo(clip_ratio=0.2, loss_agg_mode="seq-mean-token-mean")
    close(pg, sum(seq_means) / 2)
    # negative control: the token mean differs on these rows of 4 and 3 tokens
    assert not math.isclose(sum(seq_means) / 2, sum(map(sum, ref["loss"])) / 7, rel_tol=1e-6)
    w = T([[2.0, 1.0, 0.5, 1.0, 1.0], [1.0, 0.25, 1.0, 1.0, 1.0]])
    pg, *_ = _dppo(clip_ratio=0.2, rollout_is_weights=w)
    close(pg, sum(ref["loss"][i][j] * w[i][j].item() for i in range(2) for j in range(5)) / 7)


def test_every_registered_mode_runs_and_unknown_modes_name_the_key():
    expected = {"vanilla", "gspo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean", "sapo", "dppo_tv"}
    assert set(POLICY_LOSSES) >= expected
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
