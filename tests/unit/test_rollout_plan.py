"""The reshard bucket plan (a pure function of the weight tables) and engine selection errors."""

import math

import pytest

from megatron_rl.config import RolloutConfig
from megatron_rl.model_args import model_args_from_hf_config
from megatron_rl.models.random_hf import QWEN25_1_5B, TINY
from megatron_rl.rollout import create_engine
from megatron_rl.rollout.bucket_plan import plan_buckets
from megatron_rl.weights.tables import hf_shapes


def args_of(arch_cls: str, **dims):
    hf = dict(architectures=[arch_cls], **TINY)
    hf.update(dims)
    return model_args_from_hf_config(hf)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_plan_covers_every_hf_tensor_once(tie, tp, pp):
    args = args_of("Qwen2ForCausalLM", tie_word_embeddings=tie)
    shapes = hf_shapes(args)
    expected = {k for k in shapes if not (tie and k == "lm_head.weight")}
    bucket_bytes = 20_000
    plan = plan_buckets(args, tp, pp, bucket_bytes, itemsize=2)
    names = [t.name for b in plan for s in b.params for t in s.tensors]
    assert len(names) == len(set(names)) and set(names) == expected
    assert names[0] == "model.embed_tokens.weight"
    assert ("lm_head.weight" in names) == (not tie)
    stages = [b.stage for b in plan]
    assert stages == sorted(stages) and set(stages) == set(range(pp))  # a bucket never spans stages
    for b in plan:
        # Offsets tile the bucket; only a lone oversized parameter may exceed the limit.
        offs = sorted((t.offset, t.numel) for s in b.params for t in s.tensors)
        assert offs[0][0] == 0 and all(a + n == c for (a, n), (c, _) in zip(offs, offs[1:], strict=False))
        assert sum(n for _, n in offs) == b.numel
        assert b.numel * 2 <= bucket_bytes or len(b.params) == 1
        for s in b.params:
            for t in s.tensors:
                assert t.shape == tuple(shapes[t.name])


def test_fused_layouts_stay_fused_and_norms_ride_along():
    plan = plan_buckets(args_of("Phi3ForCausalLM"), 2, 1, 1 << 30, itemsize=4)
    assert len(plan) == 1
    names = {t.name for s in plan[0].params for t in s.tensors}
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in names
        and "model.layers.0.mlp.gate_up_proj.weight" in names
    )
    assert "model.layers.0.input_layernorm.weight" in names


def test_qwen25_1_5b_plan_size():
    args = args_of("Qwen2ForCausalLM", **QWEN25_1_5B)
    plan = plan_buckets(args, 2, 1, 512 << 20, itemsize=2)
    total = sum(b.numel for b in plan)
    assert total == sum(math.prod(s) for k, s in hf_shapes(args).items() if k != "lm_head.weight")
    assert total == args.num_params() + 28 * (1536 + 2 * 256)  # + q/k/v biases
    assert (
        len(plan) == math.ceil(total * 2 / (512 << 20)) or len(plan) == math.ceil(total * 2 / (512 << 20)) + 1
    )


def test_bad_bucket_size_and_engine_name_are_explained():
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes"):
        plan_buckets(args_of("LlamaForCausalLM"), 1, 1, 0, 2)
    with pytest.raises(ValueError, match="rollout.name"):
        create_engine(RolloutConfig(name="vllm", dtype="float32"), "", None, None, 0)
    with pytest.raises(ValueError, match="rollout.dtype"):
        create_engine(RolloutConfig(name="hf", dtype="fp8"), "", None, None, 0)


def test_sglang_on_cpu_is_refused_naming_the_key_and_the_fix():
    """Scripts build engines without the pre-flight: create_engine asks the same check the pre-flight
    does, before SGLang is imported."""
    from types import SimpleNamespace

    import torch

    from megatron_rl.errors import LaunchError

    cpu = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(LaunchError) as e:
        create_engine(RolloutConfig(name="sglang", dtype="float32"), "", None, cpu, 0)
    assert str(e.value) == (
        "actor_rollout_ref.rollout.name=sglang needs a GPU, and this rank runs on cpu: on CPU set "
        "actor_rollout_ref.rollout.name=hf (the transformers engine)."
    )


def test_an_mla_layers_a_projections_share_a_bucket():
    """SGLang fuses a DeepSeek-V3 layer's q_a_proj and kv_a_proj_with_mqa within one load call: even
    with one-tensor buckets the two travel together (and everything else still one by one)."""
    from megatron_rl.models.random_hf import TINY_MOE

    hf = {**TINY, **TINY_MOE["deepseek_v3"], "architectures": ["DeepseekV3ForCausalLM"]}
    args = model_args_from_hf_config(hf)
    plan = plan_buckets(args, 1, 1, bucket_bytes=1, itemsize=2)
    buckets = [{t.name for s in b.params for t in s.tensors} for b in plan]
    for i in range(args.num_layers):
        q_a, kv_a = (f"model.layers.{i}.self_attn.{x}.weight" for x in ("q_a_proj", "kv_a_proj_with_mqa"))
        (holding,) = [b for b in buckets if q_a in b]
        assert kv_a in holding, i
        assert len(holding) == 4  # q_a, its norm, q_b, kv_a
    # every other bucket holds one parameter (its HF tensors: gate and up for linear_fc1)
    assert sum(len(b.params) == 1 for b in plan) == len(plan) - args.num_layers


def test_an_uneven_pipelines_buckets_hold_each_stages_own_layers():
    """Stages of 1 and 3 layers: every tensor once, and each bucket's layers are its stage's."""
    from megatron_rl.weights.tables import layer_index

    args = args_of("LlamaForCausalLM")  # 4 layers
    plan = plan_buckets(args, 1, 2, 20_000, itemsize=2, stage_layers=(1, 3))
    names = [t.name for b in plan for s in b.params for t in s.tensors]
    assert len(names) == len(set(names)) and set(names) == set(hf_shapes(args))
    for b in plan:
        layers = {layer_index(s.layout.name) for s in b.params} - {None}
        assert layers <= ({0} if b.stage == 0 else {1, 2, 3}), (b.stage, layers)
    even = plan_buckets(args, 1, 2, 20_000, itemsize=2)
    assert {layer_index(s.layout.name) for b in even if b.stage == 0 for s in b.params} - {None} == {0, 1}
