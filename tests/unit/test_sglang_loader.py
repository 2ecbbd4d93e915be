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
