"""The actor on Transformer Engine's layers streamed into SGLang: the sync check reads every tensor back
from the engine and agrees, and the engine's log-probs of its own sampled responses are the actor's
(within bf16 rounding of two different kernel stacks). Negative control: the same responses scored by
the actor with other weights are far off.

Needs CUDA, SGLang and Transformer Engine; skipped with the reason elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import te_spec

_WHY = te_spec.te_import_error()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_WHY is not None, reason=f"needs Transformer Engine (launch/build_te.sh): {_WHY}"),
]

DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512)
NEW = 16


def _actor_log_probs(model, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
    """log p(response token | everything before it) under ``model``, one sequence at a time."""
    from megatron_rl.models.forward import causal_padding_mask

    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            ids = torch.tensor([p + r], device="cuda")
            logits = model(ids, None, causal_padding_mask(torch.ones_like(ids)))[0].float()
            logp = torch.log_softmax(logits[len(p) - 1 : -1], -1)
            out.append(logp.gather(-1, ids[0, len(p) :, None])[:, 0])
    return out


def test_te_actor_streams_into_sglang_and_matches_its_log_probs(tmp_path):
    from megatron_rl.config import RolloutConfig
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import TrainingOptions, build_model, load_hf_weights
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import SamplingParams, create_engine
    from megatron_rl.rollout.reshard import sync_weights

    a = save_random_hf_model(str(tmp_path / "a"), "qwen2", seed=1, **DIMS)
    b = save_random_hf_model(str(tmp_path / "b"), "qwen2", seed=2, **DIMS)
    ps = init_parallel(1, 1, device="cuda")
    try:
        args = load_model_args(a)
        options = TrainingOptions(transformer_overrides=(("transformer_impl", te_spec.TRANSFORMER_ENGINE),))
        model = build_model(args, ps, dtype=torch.bfloat16, options=options)
        assert model.transformer_impl == te_spec.TRANSFORMER_ENGINE
        load_hf_weights(model, a, ps)
        cfg = RolloutConfig(
            name="sglang", dtype="bfloat16", gpu_memory_utilization=0.3, enable_cuda_graph=False,
            max_num_batched_tokens=4096,
        )  # fmt: skip
        engine = create_engine(cfg, a, args, ps, seed=0)
        try:
            stats = sync_weights(model, ps, engine, bucket_megabytes=1, dtype=torch.bfloat16)
            assert engine.checks_weights and not engine.unreadable  # every tensor was read back
            assert stats["buckets"] > 1
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(3, DIMS["vocab_size"], (16, 12), generator=g).tolist()
            samp = SamplingParams(temperature=1.0, max_new_tokens=NEW, return_logprobs=True, seed=7)
            gens = [per[0] for per in engine.generate(prompts, samp)]
        finally:
            engine.shutdown()
        responses = [gen.token_ids for gen in gens]
        engine_lp = torch.cat([torch.tensor(gen.logprobs, device="cuda") for gen in gens])
        actor_lp = torch.cat(_actor_log_probs(model, prompts, responses))
        diff = (engine_lp - actor_lp).abs()
        print(f"engine vs TE actor log-probs: mean |diff| {diff.mean():.4f}, max {diff.max():.4f}")
        assert diff.mean() < 0.03 and diff.max() < 0.3
        load_hf_weights(model, b, ps)  # negative control: another model's log-probs of the same tokens
        wrong = (engine_lp - torch.cat(_actor_log_probs(model, prompts, responses))).abs().mean()
        print(f"negative control (other weights): mean |diff| {wrong:.3f}")
        assert wrong > 10 * 0.03
    finally:
        destroy_parallel()
