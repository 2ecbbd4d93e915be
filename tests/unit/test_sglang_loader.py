"""The SGLang side of the MoE weight stream (megatron_rl.rollout.sglang_loader), on CPU: a bucket's
stacked experts written into fused expert weights of SGLang's layout, [E, 2F/tp, H] ([gate; up] rows
of the engine rank's slice) and [E, H, F/tp]. SGLang does not run on CPU, so its FusedMoE is stood in
for by a module with the attributes the loader checks (tests/gpu/test_sglang_moe.py runs the real
engine); the expected values come from the per-expert HF tensors, sliced by hand."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.model_args import model_args_from_hf_config
from megatron_rl.models.random_hf import random_hf_model
from megatron_rl.rollout.bucket_plan import make_bucket, plan_buckets
from megatron_rl.rollout.sglang_loader import bucket_header, load_bucket


class UnquantizedFusedMoEMethod:  # the class name the loader accepts
    pass


def fake_model(args, tp: int, rank: int, **overrides):
    """model.model.layers[i].mlp.experts like SGLang's FusedMoE; load_weights records its tensors."""
    e, h, f = args.num_experts, args.hidden_size, args.moe_ffn_hidden_size
    layers = []
    for _ in range(args.num_layers):
        experts = SimpleNamespace(
            w13_weight=torch.nn.Parameter(torch.zeros(e, 2 * f // tp, h), requires_grad=False),
            w2_weight=torch.nn.Parameter(torch.zeros(e, h, f // tp), requires_grad=False),
            quant_method=UnquantizedFusedMoEMethod(),
            moe_runner_config=SimpleNamespace(is_gated=True),
            moe_ep_size=1,
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


def stream(args, model, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Every HF tensor of a random bucket stream, loaded into ``model`` bucket by bucket."""
    sent = {}
    for b in plan_buckets(args, 1, 1, bucket_bytes, itemsize=4):
        bucket = make_bucket(b, torch.randn(b.numel))
        sent.update({n: t.clone() for n, t in bucket})
        load_bucket(model, [(bucket_header(bucket), bucket.flat)])
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
    "overrides", [{"use_triton_kernels": True}, {"moe_ep_size": 2}, {"quant_method": None}]
)
def test_other_layouts_load_expert_by_expert(args, overrides):
    model = fake_model(args, 1, 0, **overrides)
    sent = stream(args, model, 1 << 30)
    assert set(model.loaded) == set(sent)  # every tensor under its checkpoint name, for SGLang to place
    for n, t in model.loaded.items():
        assert torch.equal(t, sent[n]), n
    assert not model.model.layers[0].mlp.experts.w13_weight.any()  # nothing written directly


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
