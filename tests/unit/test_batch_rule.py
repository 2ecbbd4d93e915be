"""verl's batch rule in samples: data.train_batch_size x rollout.n (not the prompts) divides over the
data-parallel ranks; the sampler then deals a prompt's samples to several ranks, and the group-wise
advantages take their groups over every rank's rows."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos import advantages as advantages_module
from megatron_rl.algos.advantages import (
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.config.batch_sizes import samples_per_draw
from megatron_rl.config.load import ConfigErrors
from megatron_rl.data import ResumableDistributedSampler, regroup_samples

DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}
GRPO = ["actor_rollout_ref.model.path=/models/x", "algorithm.adv_estimator=grpo"]


def grpo_cfg(*overrides):
    return load_config(None, [*GRPO, *overrides])


def test_eight_ranks_take_four_prompts_of_eight_samples():
    # 4 prompts x n=8 = 32 samples, 4 per rank: refused before as "train_batch_size=4 must be a
    # positive multiple of 8"
    cfg = grpo_cfg(
        "actor_rollout_ref.rollout.n=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    )
    validate(cfg, world_size=8, model_dims=DIMS)
    assert samples_per_draw(cfg, 8) == 1 and samples_per_draw(cfg, 4) == 8


def test_samples_that_do_not_divide_are_refused_one_line_per_key():
    # 3 prompts x n=3 = 9 samples over 2 ranks; the mini-batch (3 x 3) cannot divide either
    cfg = grpo_cfg(
        "actor_rollout_ref.rollout.n=3",
        "data.train_batch_size=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    )
    with pytest.raises(ConfigErrors) as err:
        validate(cfg, world_size=2, model_dims=DIMS)
    lines = err.value.problems
    assert all("\n" not in line for line in lines)
    assert lines == [
        "data.train_batch_size x actor_rollout_ref.rollout.n = 3 x 3 = 9 samples must be a multiple of the "
        "data-parallel size 2, so that every rank trains the same number of samples: e.g. "
        "data.train_batch_size=4, or another actor_rollout_ref.rollout.n.",
        "actor_rollout_ref.actor.ppo_mini_batch_size x actor_rollout_ref.rollout.n = 3 x 3 = 9 samples must "
        "be a multiple of the data-parallel size 2, so that every rank trains the same number of samples: "
        "e.g. actor_rollout_ref.actor.ppo_mini_batch_size=4, or another actor_rollout_ref.rollout.n.",
    ]
    # the mini-batch divides the train batch, so whenever the samples of a step do not divide, a
    # mini-batch's do not either: both keys are named, each on its line


def test_the_micro_batch_divides_the_samples_per_rank_of_a_mini_batch():
    # 4 x 8 / 8 = 4 samples per rank per mini-batch: 3 does not divide them (verl: DP x micro must
    # divide train_batch_size x n)
    cfg = grpo_cfg(
        "actor_rollout_ref.rollout.n=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
    )
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size_per_gpu=3 .* the 4 sequences per rank"):
        validate(cfg, world_size=8, model_dims=DIMS)


def _steps(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_the_sampler_deals_samples_when_the_prompts_do_not_divide():
    ranks = [ResumableDistributedSampler(20, 4, r, 8, seed=3, group_size=8) for r in range(8)]
    whole = ResumableDistributedSampler(20, 4, 0, 1, seed=3, group_size=8)
    for step, batch in enumerate(_steps(whole, 6)):  # across an epoch boundary (5 steps per epoch)
        parts = [_steps_at(s, step) for s in ranks]
        assert all(len(p) == 4 for p in parts)  # 32 samples, 4 per rank, one position per sample
        # rank r holds samples 4r..4r+3: prompt r // 2 of the global batch, 4 of its 8 samples
        assert [p for part in parts for p in part] == [i for i in batch for _ in range(8)]
    assert ranks[0].per_draw == 1 and whole.per_draw == 8


def _steps_at(sampler, step):
    if not hasattr(sampler, "_it"):
        sampler._it = iter(sampler)
    return next(sampler._it)


def test_whole_prompts_per_rank_are_dealt_as_before():
    # train_batch_size a multiple of the DP size: each rank gets its contiguous prompts, all n samples
    ranks = [ResumableDistributedSampler(50, 8, r, 4, seed=1, group_size=5) for r in range(4)]
    plain = ResumableDistributedSampler(50, 8, 0, 1, seed=1)
    for batch in _steps(plain, 7):
        parts = [_steps_at(s, 0) for s in ranks]
        assert parts == [batch[2 * r : 2 * r + 2] for r in range(4)]
        assert all(s.per_draw == 5 for s in ranks)


def test_the_sampler_refuses_samples_that_do_not_divide():
    with pytest.raises(
        ValueError, match=r"3 x 3 samples must be a positive multiple of the data-parallel size 2"
    ):
        ResumableDistributedSampler(10, 3, 0, 2, seed=0, group_size=3)


def test_a_queue_saved_in_whole_prompts_resumes_in_samples_and_back():
    prompts, gens = [7, 9], [["a0", "a1", "a2"], ["b0", "b1", "b2"]]
    flat_p, flat_g = regroup_samples(prompts, gens, 1)
    assert flat_p == [7, 7, 7, 9, 9, 9] and flat_g == [["a0"], ["a1"], ["a2"], ["b0"], ["b1"], ["b2"]]
    assert regroup_samples(flat_p, flat_g, 3) == (prompts, gens)
    assert regroup_samples(prompts, gens, 3) == (prompts, gens)


# ---------------------------------------------------------------- groups over the ranks' rows


def _two_ranks(monkeypatch, other_uids, other_scores, rank=0):
    """dist faked as a group of two, this process rank ``rank``, the other rank holding ``other_*``."""

    def all_gather_object(out, obj, group=None):
        theirs = (list(other_uids), torch.tensor(other_scores))
        out[:] = [obj, theirs] if rank == 0 else [theirs, obj]

    monkeypatch.setattr(advantages_module.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(advantages_module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(advantages_module.dist, "get_rank", lambda group=None: rank)


def _rows(scores):
    """Outcome rewards on the last of 2 tokens (the second response ends early: 1 token)."""
    rewards = torch.zeros(len(scores), 2)
    mask = torch.ones(len(scores), 2)
    for i, s in enumerate(scores):
        rewards[i, 1] = s
    return rewards, mask


@pytest.mark.parametrize("rank", [0, 1])
def test_grpo_takes_a_group_over_both_ranks(monkeypatch, rank):
    # prompt b's 4 samples: 2 on each rank; a (rank 0) and c (rank 1) are whole
    uids = [["a", "a", "b", "b"], ["b", "b", "c", "c"]]
    scores = [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]
    _two_ranks(monkeypatch, uids[1 - rank], scores[1 - rank], rank)
    rewards, mask = _rows(scores[rank])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uids[rank], group="dp")
    # by hand: b = [1, 1, 0, 0], mean 0.5, unbiased std sqrt(1/3); a, c = [1, 0], mean 0.5, std sqrt(1/2)
    sb, sa = (1 / 3) ** 0.5 + 1e-6, 0.5**0.5 + 1e-6
    want = [[0.5 / sa, -0.5 / sa, 0.5 / sb, 0.5 / sb], [-0.5 / sb, -0.5 / sb, 0.5 / sa, -0.5 / sa]][rank]
    torch.testing.assert_close(adv[:, 0], torch.tensor(want))
    # the one-rank oracle: the same rows in one batch, no group
    all_rewards, all_mask = _rows(scores[0] + scores[1])
    oracle, _ = compute_grpo_outcome_advantage(all_rewards, all_mask, uids[0] + uids[1])
    torch.testing.assert_close(adv, oracle[4 * rank : 4 * rank + 4])
    # negative control: the rank's rows alone see b as a group of two that all score alike
    alone, _ = compute_grpo_outcome_advantage(rewards, mask, uids[rank])
    assert not torch.allclose(alone, adv)


def test_rloo_and_the_baseline_take_the_spanning_group_too(monkeypatch):
    uids = [["a", "a", "b"], ["b", "b", "c"]]
    scores = [[1.0, 0.0, 1.0], [0.0, 2.0, 5.0]]
    _two_ranks(monkeypatch, uids[1], scores[1])
    rewards, mask = _rows(scores[0])
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, uids[0], group="dp")
    # RLOO by hand: b = [1, 0, 2], the other two's mean for b's first sample: 1 -> 1 - 1 = 0
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 0.0]))
    monkeypatch.setattr(advantages_module.dist, "all_reduce", lambda t, op=None, group=None: t.mul_(2))
    base, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids[0], group="dp")
    # score - group mean before whitening: a: [0.5, -0.5], b: 1 - 1 = 0
    assert base[2, 0] == 0 and base[0, 0] > 0 > base[1, 0]


def test_groups_on_one_rank_each_exchange_only_uids_and_keep_their_numbers(monkeypatch):
    # whole prompts per rank (the layout accepted before): the result is the rank's own, bit for bit
    _two_ranks(monkeypatch, ["c", "c"], [3.0, 1.0])
    rewards, mask = _rows([1.0, 0.0, 0.25, 0.5])
    uids = ["a", "a", "b", "b"]
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uids, group="dp")
    alone, _ = compute_grpo_outcome_advantage(rewards, mask, uids)
    assert torch.equal(adv, alone)
