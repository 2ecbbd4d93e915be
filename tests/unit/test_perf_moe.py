"""train_flops (the MFU numerator) of a mixture-of-experts model counts the parameters a token passes
through (its top-k experts and the router), not every expert; a dense model's count is unchanged.
The expected values are written out by hand from the TINY / TINY_MOE dims."""

import pytest

from megatron_rl.model_args import model_args_from_hf_config
from megatron_rl.models.random_hf import QWEN3_30B_A3B, TINY, TINY_MOE
from megatron_rl.run.perf import train_flops

# a batch: tokens, response tokens, sum of squared sequence lengths
TOKENS, RESPONSES, SUM_SQ = 3000.0, 1000.0, 2.5e5

# TINY: hidden 64, 4 layers, 4 heads of 16 (2 KV heads), vocab 99, untied
H, LAYERS, HEADS, HEAD_DIM, VOCAB = 64, 4, 4, 16, 99
ATTN_WEIGHTS = H * HEAD_DIM * (2 * HEADS + 2 * 2)  # q, o + k, v = 12288
NORMS = 2 * H  # two RMSNorms per layer
HEAD = VOCAB * H  # the LM head, run on response tokens only
ATTN_SCORES = 6 * LAYERS * HEADS * HEAD_DIM * SUM_SQ


def flops(body_weights: int) -> float:
    return 6 * body_weights * TOKENS + 6 * HEAD * RESPONSES + ATTN_SCORES


def test_moe_counts_top_k_experts_and_router():
    moe = TINY_MOE["qwen3_moe"]  # 4 experts of 48, top-2, every layer MoE
    args = model_args_from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], **TINY, **moe})
    assert args.is_moe and args.moe_layers == (True,) * LAYERS
    expert = 3 * H * 48  # gate, up, down of one expert
    router = 4 * H
    active = LAYERS * (ATTN_WEIGHTS + 2 * expert + router + NORMS) + H  # + the final norm
    assert active == 124480
    got = train_flops(args, TOKENS, RESPONSES, SUM_SQ)
    assert got == pytest.approx(flops(active), rel=1e-12)
    # every expert counted (the idle two of each layer too): a different, larger number
    every = active + LAYERS * 2 * expert
    assert got < flops(every) and got != pytest.approx(flops(every), rel=1e-3)
    # the critic (no LM head) on the same trunk
    got_critic = train_flops(args, TOKENS, RESPONSES, SUM_SQ, lm_head=False)
    assert got_critic == pytest.approx(flops(active) - 6 * HEAD * RESPONSES, rel=1e-12)


def test_dense_model_is_unchanged():
    args = model_args_from_hf_config({"architectures": ["Qwen2ForCausalLM"], **TINY})
    assert not args.is_moe and args.num_active_params() == args.num_params()
    body = LAYERS * (ATTN_WEIGHTS + 3 * H * 96 + NORMS) + H
    assert body == 123456
    assert train_flops(args, TOKENS, RESPONSES, SUM_SQ) == pytest.approx(flops(body), rel=1e-12)


def test_qwen3_30b_a3b_shape_counts_about_3b_active():
    args = model_args_from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], **QWEN3_30B_A3B})
    # the published sizes: 30.5B parameters, 3.3B activated
    assert args.num_params() / 1e9 == pytest.approx(30.5, abs=0.1)
    assert args.num_active_params() / 1e9 == pytest.approx(3.3, abs=0.1)
    per_token = train_flops(args, 1.0, 0.0, 0.0)  # body only: no LM head, no attention scores
    assert per_token == 6 * (args.num_active_params() - 2 * 151936 * 2048)
