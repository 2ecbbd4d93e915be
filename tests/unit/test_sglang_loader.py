"""The SGLang side of the MoE weight stream (megatron_rl.rollout.sglang_loader), on CPU: a bucket's
stacked experts written into fused expert weights of SGLang's layout, [E, 2F/tp, H] ([gate; up] rows
of the engine rank's slice) and [E, H, F/tp]; with the engine's expert parallelism, [E/ep, ...] of the
rank's block of experts. SGLang does not run on CPU, so its FusedMoE is stood in
for by a module with the attributes the loader checks (tests/gpu/test_sglang_moe.py runs the real
engine); the expected values come from the per-expert HF tensors, sliced by hand."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.model_args import model_args_from_hf_config
from megatron_rl.models.random_hf import random_hf_model
from megatron_rl.rollout.bucket_plan import make_bucket, plan_buckets
from megatron_rl.rollout.sglang_loader import bucket_header, engine_expert_block, load_bucket


class UnquantizedFusedMoEMethod:  # the class name the loader accepts
    pass


def fake_model(args, tp: int, rank: int, ep: int = 1, ep_rank: int = 0, **overrides):
    """model.model.layers[i].mlp.experts like SGLang's FusedMoE (``tp``, ``rank``: its expert TP; ``ep``,
    ``ep_rank``: its expert parallelism, E / ep experts a rank); load_weights records its tensors."""
    e, h, f = args.num_experts // ep, args.hidden_size, args.moe_ffn_hidden_size
    layers = []
    for _ in range(args.num_layers):
        experts = SimpleNamespace(
            w13_weight=torch.nn.Parameter(torch.zeros(e, 2 * f // tp, h), requires_grad=False),
            w2_weight=torch.nn.Parameter(torch.zeros(e, h, f // tp), requires_grad=False),
            quant_method=UnquantizedFusedMoEMethod(),
            moe_runner_config=SimpleNamespace(is_gated=True),
            moe_ep_size=ep,
            moe_ep_rank=ep_rank,
            moe_tp_size=tp,
            moe_tp_rank=rank,
            num_fused_shared_experts=0,
            use_triton_kernels=False,
        )
        vars(experts).update(overrides)
        layers.append(SimpleNamespace(mlp=SimpleNamespace(experts=experts)))
    loaded: dict[str, torch.Tensor] = {}
    return SimpleNamespace(
        model=SimpleNamespace(layers=layers),
        load_weights=lambda named: loaded.update({n: t.clone() for n, t in named}),
        loaded=loaded,
    )


@pytest.fixture(scope="module")
def args():
    model = random_hf_model("qwen3_moe", seed=1, num_hidden_layers=2)
    return model_args_from_hf_config({**model.config.to_dict(), "architectures": [type(model).__name__]})


def stream(
    args, model, bucket_bytes: int, experts: range | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Every HF tensor of a random (O(1), seeded) bucket stream, loaded into ``model`` bucket by bucket;
    ``experts``: the block of routed experts the engine rank holds (bucket_header)."""
    sent = {}
    gen = torch.Generator().manual_seed(seed)
    for b in plan_buckets(args, 1, 1, bucket_bytes, itemsize=4):
        bucket = make_bucket(b, torch.randn(b.numel, generator=gen))
        sent.update({n: t.clone() for n, t in bucket})
        load_bucket(model, [(bucket_header(bucket, experts), bucket.flat)])
    return sent


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("bucket_bytes", [40_000, 1 << 30])
def test_stacked_experts_land_in_the_fused_weights(args, tp, rank, bucket_bytes):
    model = fake_model(args, tp, rank)
    sent = stream(args, model, bucket_bytes)
    s = args.moe_ffn_hidden_size // tp
    rows = slice(rank * s, (rank + 1) * s)
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        for e in range(args.num_experts):
            p = f"model.layers.{i}.mlp.experts.{e}."
            assert torch.equal(ex.w13_weight[e, :s], sent[p + "gate_proj.weight"][rows])
            assert torch.equal(ex.w13_weight[e, s:], sent[p + "up_proj.weight"][rows])
            assert torch.equal(ex.w2_weight[e], sent[p + "down_proj.weight"][:, rows])
    assert not any(".experts." in n for n in model.loaded)  # no expert went expert by expert
    assert set(model.loaded) == {n for n in sent if ".experts." not in n}
    for n, t in model.loaded.items():
        assert torch.equal(t, sent[n]), n


@pytest.mark.parametrize(
    "overrides", [{"use_triton_kernels": True}, {"num_fused_shared_experts": 1}, {"quant_method": None}]
)
def test_other_layouts_load_expert_by_expert(args, overrides):
    model = fake_model(args, 1, 0, **overrides)
    sent = stream(args, model, 1 << 30)
    assert set(model.loaded) == set(sent)  # every tensor under its checkpoint name, for SGLang to place
    for n, t in model.loaded.items():
        assert torch.equal(t, sent[n]), n
    assert not model.model.layers[0].mlp.experts.w13_weight.any()  # nothing written directly


def test_the_engine_expert_blocks_are_sglangs_layout():
    """SGLang's engine rank g of R at expert parallelism ep: EP rank g // (R / ep), a contiguous block of
    E / ep experts (its moe_tp rank g % (R / ep) cuts them); by hand for R = 4, E = 8."""
    assert [engine_expert_block(g, 4, 4, 8) for g in range(4)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
        range(6, 8),
    ]
    assert [engine_expert_block(g, 4, 2, 8) for g in range(4)] == [range(0, 4)] * 2 + [range(4, 8)] * 2
    assert engine_expert_block(3, 4, 1, 8) == range(8)
    for bad in ((4, 3, 9), (4, 8, 8), (4, 2, 7)):
        with pytest.raises(ValueError, match="must divide"):
            engine_expert_block(0, *bad)


@pytest.mark.parametrize("bucket_bytes", [40_000, 1 << 30])  # one expert a stack; all, cut at the blocks
@pytest.mark.parametrize("engine_ranks,ep", [(4, 4), (4, 2), (2, 2)])
def test_each_engine_rank_receives_and_holds_only_its_block_of_experts(args, engine_ranks, ep, bucket_bytes):
    """An engine of R ranks at expert parallelism ep: each rank's header names only its block of experts
    (nothing else reaches its worker), which lands in its fused weights at its local positions, cut by
    its expert-TP rank; over the ranks every expert's every slice is held exactly once. The stream is
    the same on every rank (as the reshard stream's buckets are)."""
    moe_tp = engine_ranks // ep
    s = args.moe_ffn_hidden_size // moe_tp
    held: dict[tuple[int, int, int], int] = {}  # (layer, expert, expert-TP slice) -> times held
    for g in range(engine_ranks):
        block = engine_expert_block(g, engine_ranks, ep, args.num_experts)
        model = fake_model(args, moe_tp, g % moe_tp, ep=ep, ep_rank=g // moe_tp)
        sent = stream(args, model, bucket_bytes, block)
        rows = slice((g % moe_tp) * s, (g % moe_tp + 1) * s)
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            assert ex.w13_weight.shape[0] == len(block)
            for local, e in enumerate(block):
                p = f"model.layers.{i}.mlp.experts.{e}."
                assert torch.equal(ex.w13_weight[local, :s], sent[p + "gate_proj.weight"][rows])
                assert torch.equal(ex.w13_weight[local, s:], sent[p + "up_proj.weight"][rows])
                assert torch.equal(ex.w2_weight[local], sent[p + "down_proj.weight"][:, rows])
                held[(i, e, g % moe_tp)] = held.get((i, e, g % moe_tp), 0) + 1
        assert not any(".mlp.experts." in n for n in model.loaded)  # no other expert reached it
        assert set(model.loaded) == {n for n in sent if ".mlp.experts." not in n}
    every = {
        (i, e, r) for i in range(args.num_layers) for e in range(args.num_experts) for r in range(moe_tp)
    }
    assert held == dict.fromkeys(every, 1)


def test_another_ranks_block_is_not_copied_in(args):
    """Negative control: a header cut for EP rank 0's block, loaded by EP rank 1, is not copied into
    rank 1's weights (they would hold the wrong experts); it goes to the model's own per-expert loader
    under the experts' checkpoint names, which SGLang drops for experts a rank does not hold."""
    model = fake_model(args, 1, 0, ep=2, ep_rank=1)
    sent = stream(args, model, 40_000, engine_expert_block(0, 2, 2, args.num_experts))
    assert not model.model.layers[0].mlp.experts.w13_weight.any()
    per_expert = {n for n in model.loaded if ".mlp.experts." in n}
    assert per_expert and all(int(n.split(".")[5]) < args.num_experts // 2 for n in per_expert)
    assert all(torch.equal(model.loaded[n], sent[n]) for n in per_expert)


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_a_cut_stack_goes_to_the_per_expert_loader_under_its_own_names(args, ep_rank):
    """Weights the loader does not write itself (here: a transposed layout), at expert parallelism 2 with
    every layer's experts in one stack: the rank's half of the stack reaches SGLang's per-expert loader
    under exactly its experts' checkpoint names, with their values."""
    model = fake_model(args, 1, 0, ep=2, ep_rank=ep_rank, use_triton_kernels=True)
    block = engine_expert_block(ep_rank, 2, 2, args.num_experts)
    sent = stream(args, model, 1 << 30, block)
    routed = {n for n in sent if ".mlp.experts." in n}
    mine = {n for n in routed if int(n.split(".")[5]) in block}
    assert mine and mine != routed
    assert {n for n in model.loaded if ".mlp.experts." in n} == mine
    assert all(torch.equal(model.loaded[n], sent[n]) for n in mine)


def test_weights_that_hold_another_block_are_not_written_directly(args):
    """SGLang with redundant experts holds more slots than num_experts / ep: the streamed block is not
    its layout, so the per-expert loader places the experts."""
    model = fake_model(args, 1, 0, ep=2, ep_rank=0)
    for layer in model.model.layers:  # one redundant slot
        ex = layer.mlp.experts
        ex.w13_weight = torch.nn.Parameter(torch.zeros(ex.w13_weight.shape[0] + 1, *ex.w13_weight.shape[1:]))
        ex.w2_weight = torch.nn.Parameter(torch.zeros(ex.w2_weight.shape[0] + 1, *ex.w2_weight.shape[1:]))
    stream(args, model, 1 << 30, engine_expert_block(0, 2, 2, args.num_experts))
    assert not model.model.layers[0].mlp.experts.w13_weight.any()
    assert any(".mlp.experts." in n for n in model.loaded)


def test_the_expert_score_bias_travels_in_float32_in_a_bf16_bucket():
    """A bf16 stream carries sigmoid routing's bias as float32 values (rounded to bf16 it would route
    other tokens than the trainer's): the bucket's view and the loader's view of the header both read
    the exact float32 values; every other tensor is bf16."""
    model = random_hf_model("deepseek_v3", seed=2, num_hidden_layers=2)
    dsv3 = model_args_from_hf_config({**model.config.to_dict(), "architectures": [type(model).__name__]})
    got, sent = {}, {}
    recorder = SimpleNamespace(model=SimpleNamespace(layers=[]), load_weights=lambda n: got.update(n))
    for b in plan_buckets(dsv3, 1, 1, 1 << 14, itemsize=2):
        flat = torch.zeros(b.numel, dtype=torch.bfloat16)
        bucket = make_bucket(b, flat)
        for name, t in bucket:  # what the stream's scatter does: a copy into each view
            value = torch.randn(t.shape, dtype=torch.float64) * 0.3 + 0.123456789
            t.copy_(value)
            sent[name] = value.to(t.dtype)
        load_bucket(recorder, [(bucket_header(bucket), bucket.flat)])
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert sent[bias].dtype == torch.float32 and got[bias].dtype == torch.float32
    assert torch.equal(got[bias], sent[bias])
    assert not torch.equal(sent[bias], sent[bias].to(torch.bfloat16).float())  # bf16 would round it
    others = [n for n in sent if n != bias and "e_score" not in n]
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], sent[n]) for n in others)


def test_glm_routers_cached_fp32_weight_follows_the_update():
    """SGLang's GLM-4.5 router computes with an fp32 copy of its weight made at its first forward: the
    loader makes it again in place after loading the router (the CUDA graph keeps its memory)."""
    gate = torch.nn.Module()
    gate.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16), requires_grad=False)
    gate._weight_fp32 = torch.zeros(4, 8)
    cached = gate._weight_fp32
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.model.layers[0].mlp = torch.nn.Module()
    root.model.layers[0].mlp.gate = gate

    def load_weights(named):
        for name, t in named:
            root.get_parameter(name).data.copy_(t)

    root.load_weights = load_weights
    new = torch.randn(4, 8).to(torch.bfloat16)
    bucket = [("model.layers.0.mlp.gate.weight", new)]
    flat = new.reshape(-1)
    header = __import__("json").dumps({"tensors": [[bucket[0][0], [4, 8], 0]], "stacks": []})
    load_bucket(root, [(header, flat)])
    assert gate._weight_fp32 is cached and torch.equal(cached, new.float())


# -- the sync check's read-back at the engine's DP attention and expert parallelism -------------------


class RowParallelLinear(torch.nn.Module):  # the class names the read-back keys on
    def __init__(self, full: torch.Tensor, ranks: int, rank: int) -> None:
        super().__init__()
        per = full.shape[1] // ranks
        self.weight = torch.nn.Parameter(full[:, rank * per : (rank + 1) * per].clone(), requires_grad=False)
        self.tp_size, self.tp_rank, self.input_size_per_partition = ranks, rank, per


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, full: torch.Tensor, ranks: int, rank: int) -> None:
        super().__init__()
        per = full.shape[0] // ranks
        self.weight = torch.nn.Parameter(full[rank * per : (rank + 1) * per].clone(), requires_grad=False)
        self.tp_size, self.tp_rank = ranks, rank


def engine_rank_model(args, full: dict[str, torch.Tensor], engine_ranks: int, dp: int, ep: int, g: int):
    """Engine rank ``g``'s copy of ``full``: o_proj over its attention group (engine_ranks / dp ranks,
    SGLang's DP attention), kv_b_proj over every rank, the experts of its EP block (expert TP 1)."""
    attn = engine_ranks // dp
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    layer = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    layer.self_attn = torch.nn.Module()
    layer.self_attn.o_proj = RowParallelLinear(full["model.layers.0.self_attn.o_proj.weight"], attn, g % attn)
    layer.self_attn.kv_b_proj = ColumnParallelLinear(
        full["model.layers.0.self_attn.kv_b_proj.weight"], engine_ranks, g
    )
    block = engine_expert_block(g, engine_ranks, ep, args.num_experts)
    fake = fake_model(args, 1, 0, ep=ep, ep_rank=block.start // len(block)).model.layers[0].mlp.experts
    experts = torch.nn.Module()
    for k, v in vars(fake).items():
        setattr(experts, k, v)
    for local, e in enumerate(block):
        p = f"model.layers.0.mlp.experts.{e}."
        experts.w13_weight.data[local] = torch.cat([full[p + "gate_proj.weight"], full[p + "up_proj.weight"]])
        experts.w2_weight.data[local] = full[p + "down_proj.weight"]
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = experts
    return root


def test_read_back_counts_each_piece_once_under_dp_attention_and_expert_parallelism(args):
    """An engine of 4 ranks, DP attention 2 and expert parallelism 4: each rank's shares of o_proj (held
    by both attention groups: each copy counts half), kv_b_proj (over all 4) and every expert (on one EP
    rank each) add up to the checksum of the whole tensor; a wrong value on one rank is seen, in either
    attention group's copy."""
    from megatron_rl.rollout.checksums import checksums_match, tensor_checksum
    from megatron_rl.rollout.sglang_loader import engine_share

    h, f = args.hidden_size, args.moe_ffn_hidden_size
    gen = torch.Generator().manual_seed(3)
    full = {
        "model.layers.0.self_attn.o_proj.weight": torch.randn(h, 8, generator=gen),
        "model.layers.0.self_attn.kv_b_proj.weight": torch.randn(8, h, generator=gen),
    }
    for e in range(args.num_experts):
        p = f"model.layers.0.mlp.experts.{e}."
        full |= {p + "gate_proj.weight": torch.randn(f, h, generator=gen)}
        full |= {p + "up_proj.weight": torch.randn(f, h, generator=gen)}
        full |= {p + "down_proj.weight": torch.randn(h, f, generator=gen)}
    ranks = [engine_rank_model(args, full, 4, 2, 4, g) for g in range(4)]

    def summed(models) -> torch.Tensor:
        out = []
        for name, t in full.items():
            shares = [
                engine_share(m, dict(m.named_parameters()), name, list(t.shape), g, len(models))
                for g, m in enumerate(models)
            ]
            assert all(s is not None for s in shares), name  # every rank places its piece (or none)
            out.append(torch.stack(shares).sum(0))
        return torch.stack(out)

    want = torch.stack([tensor_checksum(t) for t in full.values()])
    numel = torch.tensor([t.numel() for t in full.values()])
    assert checksums_match(want, summed(ranks), numel).all()
    names = list(full)
    for g in (1, 3):  # o_proj: in the first attention group's copy, then in the second's
        o_proj = ranks[g].model.layers[0].self_attn.o_proj.weight.data
        kept = o_proj.clone()
        o_proj[0, 0] += 1.0
        bad = ~checksums_match(want, summed(ranks), numel)
        assert {names[i] for i in bad.nonzero()[:, 0].tolist()} == {
            "model.layers.0.self_attn.o_proj.weight"
        }, g
        o_proj.copy_(kept)
    last = args.num_experts - 1  # on rank 3, the last of its block
    ranks[3].model.layers[0].mlp.experts.w2_weight.data[-1, 0, 0] += 1.0
    bad = ~checksums_match(want, summed(ranks), numel)
    assert {names[i] for i in bad.nonzero()[:, 0].tolist()} == {
        f"model.layers.0.mlp.experts.{last}.down_proj.weight"
    }
