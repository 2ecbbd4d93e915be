"""Token-budget micro-batches (use_dynamic_bsz): the plan, the trimmed micro-batches, the keys.

The numerical equivalence of the dynamic and fixed paths (log-probs, values, losses, updated weights at
TP1/TP2/PP2/DP2) is checked in tests/distributed/test_ppo_layouts.py (the dyn_* layouts).
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.microbatches import (
    MicroBatching,
    TokenStats,
    micro_batches,
    split_to_count,
    token_budget_groups,
)

DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}


def ragged_batch(prompt_lens: list[int], response_lens: list[int], p: int = 8, r: int = 6) -> RolloutBatch:
    """Rows whose tokens encode (row, position) so that a slicing error shows in the values."""
    b = len(prompt_lens)
    pos = torch.arange(p)
    prompt_mask = pos[None] >= p - torch.tensor(prompt_lens)[:, None]
    resp_mask = torch.arange(r)[None] < torch.tensor(response_lens)[:, None]
    rows = torch.arange(b)[:, None] * 100
    prompts = torch.where(prompt_mask, rows + pos + 1, 0)
    responses = torch.where(resp_mask, rows + 50 + torch.arange(r), 0)
    batch = RolloutBatch.from_tokens(
        prompts, prompt_mask, responses, resp_mask, [SeqMeta(str(i)) for i in range(b)]
    )
    batch.advantages = torch.randn(b, r) * batch.response_mask
    return batch


def padded_size(rows: list[int], lengths: list[int], multiple: int = 1) -> int:
    return len(rows) * (-(-max(lengths[i] for i in rows) // multiple) * multiple)


@pytest.mark.parametrize("multiple", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_groups_cover_every_row_once_within_the_budget(seed, multiple):
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    lengths = [rng.randint(1, 40) + rng.randint(1, 200) for _ in range(n)]
    budget = rng.randint(260, 2000)
    groups = token_budget_groups(lengths, budget, multiple, "k")
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert all(padded_size(g, lengths, multiple) <= budget for g in groups)
    # a group is closed only when the next (shorter) sequence would not fit it
    for a, nxt in zip(groups, groups[1:], strict=False):
        assert padded_size(a + nxt[:1], lengths, multiple) > budget
    # length-sorted: a group's padding is bounded by the length step to the next group's longest
    processed = sum(padded_size(g, lengths, multiple) for g in groups)
    steps = sum(len(g) * (lengths[g[0]] - lengths[g[-1]]) for g in groups)
    assert processed <= sum(lengths) + steps + (multiple - 1) * n


def test_a_sequence_longer_than_the_budget_names_the_key():
    with pytest.raises(
        ConfigError,
        match=r"60 tokens does not fit critic\.forward_max_token_len_per_gpu=50: raise .* at least 60",
    ):
        token_budget_groups([30, 60], 50, 1, "critic.forward_max_token_len_per_gpu")


def test_split_to_count_keeps_rows_and_never_grows_a_group():
    lengths = [6, 7, 8, 9, 10, 11, 12]
    groups = token_budget_groups(lengths, 40, 1, "k")
    split = split_to_count(groups, 6, lengths)
    assert len(split) == 6
    assert sorted(i for g in split for i in g) == list(range(7))
    assert max(padded_size(g, lengths) for g in split) <= max(padded_size(g, lengths) for g in groups)
    assert len(split_to_count(groups, 99, lengths)) == 7  # one row each at most


def test_compacted_micro_batches_hold_the_same_tokens():
    p_lens, r_lens = [3, 8, 2, 5, 1], [6, 1, 2, 4, 3]
    batch = ragged_batch(p_lens, r_lens)
    micro, groups = micro_batches(batch, MicroBatching(size=2, max_tokens=20))
    assert sorted(i for g in groups for i in g) == list(range(5))
    for mb, rows in zip(micro, groups, strict=True):
        sub = batch.select(rows)
        longest = max(p_lens[i] + r_lens[i] for i in rows)
        r_max = max(r_lens[i] for i in rows)
        assert mb.input_ids.shape == mb.attention_mask.shape == (len(rows), longest)
        assert mb.responses.shape == mb.advantages.shape == mb.response_index.shape == (len(rows), r_max)
        # every real token kept, in order, from position 0 of its row
        assert torch.equal(mb.input_ids[mb.attention_mask.bool()], sub.input_ids[sub.attention_mask.bool()])
        assert torch.equal(mb.attention_mask.sum(1), sub.attention_mask.sum(1))
        assert bool(mb.attention_mask[:, 0].all())
        assert torch.equal(mb.advantages, sub.advantages[:, :r_max])
        # the position before each real response token holds the token before it
        for k, i in enumerate(rows):
            idx = mb.response_index[k, : r_lens[i]]
            assert torch.equal(mb.input_ids[k, idx + 1], sub.responses[k, : r_lens[i]])
            assert mb.input_ids[k, idx[0]] == sub.prompts[k, -1]


def test_fixed_path_fills_the_last_micro_batch_and_counts_padding():
    batch = ragged_batch([3, 8, 2, 5, 1], [6, 1, 2, 4, 3])
    stats = TokenStats()
    micro, groups = micro_batches(batch, MicroBatching(size=2), stats=stats)
    assert [len(m) for m in micro] == [2, 2, 2] and groups == [[0, 1], [2, 3], [4]]
    assert all(m.input_ids.shape[1] == 14 for m in micro)
    real = 3 + 8 + 2 + 5 + 1 + 6 + 1 + 2 + 4 + 3
    assert stats.processed == 6 * 14 and stats.real == real
    assert stats.padding_fraction() == pytest.approx(1 - real / 84)
    # the token budget on the same rows: less padding
    dyn = TokenStats()
    micro_batches(batch, MicroBatching(size=2, max_tokens=20), stats=dyn)
    assert dyn.real == real and dyn.padding_fraction() < stats.padding_fraction()
    assert all(t <= 20 for t in dyn.micro_batch_tokens[0])


def test_keys_follow_the_actor_like_verl():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        ],
    )
    arr = cfg.actor_rollout_ref
    assert (
        arr.rollout.log_prob_use_dynamic_bsz
        and arr.ref.log_prob_use_dynamic_bsz
        and cfg.critic.use_dynamic_bsz
    )
    assert arr.rollout.log_prob_max_token_len_per_gpu == arr.ref.log_prob_max_token_len_per_gpu == 4096
    assert cfg.critic.ppo_max_token_len_per_gpu == cfg.critic.forward_max_token_len_per_gpu == 32768
    plain = load_config(None, ["actor_rollout_ref.model.path=/m"])
    assert not plain.actor_rollout_ref.actor.use_dynamic_bsz and not plain.critic.use_dynamic_bsz


def test_budget_shorter_than_the_longest_sequence_names_the_key():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1000",
            "actor_rollout_ref.actor.use_kl_loss=true",  # the reference model runs
            "data.max_prompt_length=512",
            "data.max_response_length=1024",
        ],
    )
    with pytest.raises(
        ConfigError, match=r"actor_rollout_ref\.ref\.log_prob_max_token_len_per_gpu=1000 .* 1536"
    ):
        validate(cfg, world_size=4, model_dims=DIMS)
    cfg.actor_rollout_ref.actor.use_kl_loss = False  # no reference pass: its budget does not matter
    validate(cfg, world_size=4, model_dims=DIMS)


def test_dynamic_batching_lifts_the_micro_batch_divisibility_rule():
    overrides = ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"]
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu"):
        validate(load_config(None, overrides), world_size=4, model_dims=DIMS)
    validate(load_config(None, [*overrides, "actor_rollout_ref.actor.use_dynamic_bsz=true"]), 4, DIMS)


def test_reward_model_dynamic_batching_is_refused():
    with pytest.raises(ConfigError, match="reward_model.use_dynamic_bsz"):
        load_config(None, ["actor_rollout_ref.model.path=/m", "reward_model.use_dynamic_bsz=true"])


def test_an_over_budget_sequence_fails_the_pass_naming_the_key():
    batch = ragged_batch([3, 8], [6, 1])
    with pytest.raises(ConfigError, match=r"9 tokens does not fit k=8: raise k to at least 9"):
        micro_batches(batch, MicroBatching(size=2, max_tokens=8, key="k"))
    with pytest.raises(ConfigError, match="use_dynamic_bsz needs k"):
        MicroBatching.of(4, True, None, "k")
