"""Packed sequences (``*.megatron.use_remove_padding``, megatron_rl/models/packing.py): the THD layout of a
micro-batch, the core attention over its segments against a hand computation, the token budget of
packed micro-batches, and the config key's defaults and checks. The whole models run packed against
the padded passes and the HF model in tests/distributed/test_ppo_layouts.py (thd_*), test_vpp.py and
test_routing_replay.py (*_thd)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.microbatches import token_budget_groups
from megatron_rl.models.layers import SDPAttention
from megatron_rl.models.packing import pack

DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}


def micro_batch():
    """3 rows of width 7: a left-padded prompt + right-padded response each (real tokens contiguous)."""
    ids = torch.tensor(
        [
            [0, 0, 11, 12, 13, 14, 0],
            [21, 22, 23, 24, 25, 26, 27],
            [0, 0, 0, 31, 32, 0, 0],
        ]
    )
    return ids, (ids > 0).long()


def test_pack_lays_the_real_tokens_row_after_row():
    ids, keep = micro_batch()
    p = pack(ids, keep)
    assert p.ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 24, 25, 26, 27, 31, 32]]
    assert p.params.qkv_format == "thd"
    assert p.params.bounds == (0, 4, 11, 13)
    assert p.params.cu_seqlens_q.tolist() == [0, 4, 11, 13] and p.params.cu_seqlens_q.dtype == torch.int32
    assert p.params.max_seqlen_q == p.params.max_seqlen_kv == 7
    # every real (row, column) finds its token at its packed position
    real = keep.bool()
    assert torch.equal(p.ids[0][p.index[real]], ids[real])
    assert p.index.min() >= 0 and p.index.max() < p.tokens  # padding columns point at real tokens too


def test_pack_fills_up_to_the_multiple_with_a_segment_of_its_own():
    ids, keep = micro_batch()
    p = pack(ids, keep, multiple=4)  # 13 real tokens -> 16 (sequence parallelism at TP4)
    assert p.tokens == 16 and p.ids[0, 13:].tolist() == [0, 0, 0]
    assert p.params.bounds == (0, 4, 11, 13, 16)  # the fillers attend to none of the real tokens
    assert pack(ids, keep, multiple=13).params.bounds == (0, 4, 11, 13)  # exact: no filler segment


def test_packed_positions_of_slices_and_per_row_columns():
    ids, keep = micro_batch()
    p = pack(ids, keep)
    assert p.positions(slice(3, 5)).tolist() == [[1, 2], [7, 8], [11, 12]]
    where = torch.tensor([[2, 5], [0, 6], [3, 4]])  # per row: each row's own columns
    assert p.positions(where).tolist() == [[0, 3], [4, 10], [11, 12]]
    assert torch.equal(p.positions(None), p.index)


def test_packed_rows_of_per_token_tensors():
    ids, keep = micro_batch()
    p = pack(ids, keep, multiple=8)
    routed = torch.stack([ids * 10, ids * 10 + 1], -1)[:, :, None]  # [b, s, L=1, k=2]
    rows = p.rows(routed, -1)
    assert rows.shape == (1, 16, 1, 2)
    assert rows[0, :13, 0, 0].tolist() == (p.ids[0, :13] * 10).tolist()
    assert (rows[0, 13:] == -1).all()


def _oracle(q, k, v, bounds, scale):
    """float64 softmax(q k^T * scale) v, causal inside each segment, none across; GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        for t in range(start, stop):
            s = torch.einsum("hd,jhd->hj", q[t].double(), k[start : t + 1].double()) * scale
            out[t] = torch.einsum("hj,jhd->hd", s.softmax(-1), v[start : t + 1].double())
    return out.reshape(q.shape[0], -1)


@pytest.mark.parametrize("kv_heads,v_dim", [(2, 8), (4, 8), (2, 6)], ids=["gqa", "mha", "mla-value-width"])
@pytest.mark.parametrize(
    "bounds",
    [(0, 5, 6, 13, 16), (0, 3, 7, 10, 14, 15, 16)],
    ids=["distinct-lengths", "repeated-lengths"],  # one call per segment; one per length (gathered)
)
def test_segment_attention_matches_a_hand_computation(kv_heads, v_dim, bounds):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 4, 8, generator=g) * 2  # O(1) scores: a leak across segments shows
    k = torch.randn(16, kv_heads, 8, generator=g) * 2
    v = torch.randn(16, kv_heads, v_dim, generator=g)
    scale = 1 / math.sqrt(8)
    attn = SDPAttention(None, 1, None, None, softmax_scale=scale)

    class Params:  # what the core attention reads of megatron's PackedSeqParams
        pass

    params = Params()
    params.bounds = bounds
    got = attn(q, k, v, None, packed_seq_params=params)
    assert got.shape == (16, 4 * v_dim)
    assert (got.double() - _oracle(q, k, v, bounds, scale)).abs().max() < 1e-5
    # negative control: one segment over the whole row (sequences attending to each other) is far off
    params.bounds = (0, 16)
    leaked = attn(q, k, v, None, packed_seq_params=params)
    assert (leaked.double() - _oracle(q, k, v, bounds, scale)).abs().max() > 0.1


def test_packed_segments_keep_off_cudnns_attention_and_padded_rows_keep_torchs_choice(monkeypatch):
    """cuDNN's attention builds a plan for every new shape, and ragged packed segments bring new ones in
    every micro-batch: their calls run with it switched off (flash / memory-efficient / math), while
    padded rows (fixed shapes within a pass) and the caller's settings afterwards are left as they were."""
    import megatron_rl.models.layers as layers

    seen = []
    sdpa = layers.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", recording)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    attn = SDPAttention(None, 1, None, None)
    q, kv = torch.randn(16, 4, 8), torch.randn(16, 2, 8)

    class Params:
        bounds = (0, 5, 6, 13, 16)

    attn(q, kv, kv, None, packed_seq_params=Params())
    assert seen == [False] * 4  # four lengths (5, 1, 7, 3), four calls, none on cuDNN
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    seen.clear()
    attn(q[:, None], kv[:, None], kv[:, None], None)  # padded rows [s, b, heads, d]
    assert seen == [before]


def test_packed_token_budget_counts_real_tokens():
    lengths = [10, 3, 9, 2, 4, 8]
    padded = token_budget_groups(lengths, 20, 1, "k")
    packed = token_budget_groups(lengths, 20, 1, "k", packed=True)
    assert sorted(i for g in packed for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 20 for g in packed)
    assert len(packed) < len(padded)  # rows x longest wastes the budget on padding
    assert packed == [[0, 2], [5, 4, 1, 3]]  # longest first; a group takes the next while it fits
    # rounded up to the TP multiple as the forward pads it: 19 -> 20 fits, 21 does not
    assert token_budget_groups([10, 9, 2], 20, 4, "k", packed=True) == [[0, 1], [2]]
    with pytest.raises(ConfigError, match="raise k to at least 24"):
        token_budget_groups([21, 3], 20, 4, "k", packed=True)


def test_packed_fixed_size_passes_take_no_filler_rows():
    from megatron_rl.microbatches import MicroBatching, TokenStats, micro_batches
    from tests.unit.test_microbatches import ragged_batch

    batch = ragged_batch([3, 8, 5, 2, 7, 4, 6], [6, 1, 4, 2, 5, 3, 1])
    stats = {packed: TokenStats() for packed in (False, True)}
    padded, rows = micro_batches(batch, MicroBatching(3), stats=stats[False])
    packed, packed_rows = micro_batches(batch, MicroBatching(3), stats=stats[True], packed=True)
    assert rows == packed_rows == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(mb) for mb in padded] == [3, 3, 3]  # one shape: copies of row 0 fill the last one
    assert [len(mb) for mb in packed] == [3, 3, 1]
    # a packed micro-batch costs its real tokens; padded rows cost rows x the batch's width
    assert stats[True].processed == stats[True].real == int(batch.attention_mask.sum())
    assert stats[False].processed == 9 * batch.input_ids.shape[1]


def cfg_with(*overrides):
    return load_config(None, ["actor_rollout_ref.model.path=/models/x", *overrides])


def test_packed_by_default_where_the_attention_can_run_it():
    cfg = cfg_with()
    sections = (
        cfg.actor_rollout_ref.actor.megatron,
        cfg.actor_rollout_ref.ref.megatron,
        cfg.critic.megatron,
        cfg.reward_model.megatron,
    )
    assert all(m.use_remove_padding is True for m in sections)
    # the reference and reward models follow the actor (as verl's interpolations); the critic is its own
    cfg = cfg_with("actor_rollout_ref.actor.megatron.use_remove_padding=false")
    assert cfg.actor_rollout_ref.ref.megatron.use_remove_padding is False
    assert cfg.reward_model.megatron.use_remove_padding is False
    assert cfg.critic.megatron.use_remove_padding is True
    # megatron's local attention: padded passes unless asked otherwise
    cfg = cfg_with("actor_rollout_ref.actor.megatron.use_sdpa_attention=false")
    assert cfg.actor_rollout_ref.actor.megatron.use_remove_padding is False
    validate(cfg, world_size=1, model_dims=DIMS)


def test_packing_without_the_sdpa_attention_is_refused_naming_the_key():
    cfg = cfg_with("critic.megatron.use_sdpa_attention=false", "critic.megatron.use_remove_padding=true")
    with pytest.raises(ConfigError, match=r"critic\.megatron\.use_remove_padding=true .*use_sdpa_attention"):
        validate(cfg, world_size=1, model_dims=DIMS)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    return save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "qwen3"), "qwen3", num_hidden_layers=2)


@pytest.mark.parametrize(
    "recompute",
    [None, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)]
    + [dict(recompute_granularity="selective")],
    ids=["plain", "full-recompute", "selective-recompute"],
)
def test_a_packed_forward_and_backward_equal_the_padded_ones(ps, hf_dir, recompute):
    """The model called on the packed row (with activation recompute too, which re-runs attention with
    the packed parameters) gives the padded row's logits at every real token and the same gradients."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
    from megatron_rl.models.forward import causal_padding_mask

    ids, keep = micro_batch()
    ids = torch.where(keep.bool(), ids % 90 + 3, 0)
    real = keep.bool()
    args = load_model_args(hf_dir)

    def run(options, packed: bool):
        model = build_model(args, ps, "actor", options=options)
        load_hf_weights(model, hf_dir, ps)
        model.train()
        if packed:
            p = pack(ids, keep)
            logits = model(p.ids, None, None, packed_seq_params=p.params)[0][p.index[real]]
        else:
            logits = model(ids, None, causal_padding_mask(keep))[real]
        logits.float().logsumexp(-1).sum().backward()  # every real token's output in the loss
        return logits.detach(), {n: q.grad for n, q in model.named_parameters()}

    want, want_grads = run(TrainingOptions(), packed=False)
    got, grads = run(TrainingOptions(**(recompute or {})), packed=True)
    assert want.abs().max() > 1.0  # O(1) weights: a leak across rows would show
    assert (got - want).abs().max() < 1e-4
    assert all((grads[n] - g).abs().max() < 1e-4 for n, g in want_grads.items())
