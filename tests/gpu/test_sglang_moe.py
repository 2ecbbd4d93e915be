"""An MoE actor (Qwen3-MoE; Qwen2-MoE with its gated shared expert; GLM-4.5 and DeepSeek-V3 with sigmoid
routing, the expert-score bias and a shared expert, DeepSeek-V3's multi-latent attention) streamed into
SGLang on one GPU: the routed experts travel as stacked runs and
are copied into SGLang's fused expert weights (megatron_rl.rollout.sglang_loader). The engine's
greedy outputs must be what transformers computes on the same weights (the oracle of test_sglang.py;
its criteria, with a wider allowance for near-ties of the router), with buckets small enough that a
layer's experts split over several of them; after a second sync of other weights the outputs must
follow (negative control: the old outputs judged against the new model fail).

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_sglang import agreement, judge, tokens

pytestmark = pytest.mark.gpu

DIMS = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
)
# Each family's own fields on top of DIMS (8 routed experts, top-2, a dense first layer where the
# family has one).
FAMILIES = {
    "qwen3_moe": {},
    "qwen2_moe": dict(shared_expert_intermediate_size=256, norm_topk_prob=False),
    "glm4_moe": dict(
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
        attention_bias=True, head_dim=64, routed_scaling_factor=1.5,
    ),
    "deepseek_v3": dict(
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_key_value_heads=4, rope_scaling=None,
    ),
}  # fmt: skip
ROUTING_TIE = 1.0
"""logits: a bf16 rounding that flips a near-tie of the router picks another expert for a token, which
moves its logits by more than a dense model's near-ties (test_sglang.TIE); the token-level criteria
below are test_sglang's."""


def assert_greedy_ok(res: dict) -> None:
    assert res["worst_gap"] < ROUTING_TIE, res
    assert res["argmax"] >= 0.9, res
    assert res["exact"] >= 0.5, res


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_moe_sync_through_fused_experts_matches_transformers(tmp_path, arch):
    from megatron_rl.config import RolloutConfig
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import SamplingParams, create_engine
    from megatron_rl.rollout.bucket_plan import plan_buckets
    from megatron_rl.rollout.reshard import sync_weights

    dims = {**DIMS, **FAMILIES[arch]}
    if arch in ("glm4_moe", "deepseek_v3"):
        dims.pop("num_experts")
    a = save_random_hf_model(str(tmp_path / "a"), arch, seed=1, **dims)
    b = save_random_hf_model(str(tmp_path / "b"), arch, seed=2, **dims)
    ps = init_parallel(1, 1, device="cuda")
    args = load_model_args(a)
    model = build_model(args, ps, dtype=torch.bfloat16)
    cfg = RolloutConfig(
        name="sglang",
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        enable_cuda_graph=False,
        max_num_batched_tokens=4096,
    )
    engine = create_engine(cfg, a, args, ps, seed=0)
    try:
        mb = 0.5  # a layer's 8 experts are 1.5 MiB of bf16: they split over buckets
        plan = plan_buckets(args, 1, 1, int(mb * 2**20), 2)
        assert any(
            len(st.names) < 2 * DIMS["num_experts"] for b_ in plan for st in b_.stacks if st.proj == "w13"
        )
        greedy = SamplingParams(greedy=True, max_new_tokens=16)
        prompts = torch.randint(
            3, DIMS["vocab_size"], (32, 12), generator=torch.Generator().manual_seed(0)
        ).tolist()
        load_hf_weights(model, a, ps)
        sync_weights(model, ps, engine, bucket_megabytes=mb, dtype=torch.bfloat16)
        before = tokens(engine.generate(prompts, greedy))
        assert_greedy_ok(judge(a, prompts, before))
        load_hf_weights(model, b, ps)
        sync_weights(model, ps, engine, bucket_megabytes=mb, dtype=torch.bfloat16)
        after = tokens(engine.generate(prompts, greedy))
        assert_greedy_ok(judge(b, prompts, after))
        assert agreement(before, after) < 0.5
        stale = judge(b, prompts, before)
        assert stale["worst_gap"] > 2 * ROUTING_TIE and stale["argmax"] < 0.5, stale
    finally:
        engine.shutdown()
        destroy_parallel()
