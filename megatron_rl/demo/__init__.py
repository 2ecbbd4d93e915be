"""The embedded CPU demo: a tiny random Llama, the toy tokenizer and the toy dataset (toy.py).

    python -m megatron_rl.demo --out .demo
    torchrun --nproc_per_node=2 -m megatron_rl.train --config yaml/cpu_demo.yaml

``--reward-model`` also writes ``OUT/reward_model``: a tiny random Llama ``...ForSequenceClassification``
(one score output) with the demo's tokenizer, for trying ``reward_model.enable`` (its scores are
random, so the policy learns nothing from them)::

    python -m megatron_rl.demo --out .demo --reward-model
    torchrun --nproc_per_node=2 -m megatron_rl.train --config yaml/cpu_demo.yaml \
        reward_model.enable=true reward_model.model.path=.demo/reward_model trainer.total_training_steps=3

``--moe`` also writes ``OUT/model_moe``: a tiny random Qwen3-MoE actor (4 experts, top-2) with the demo's
tokenizer, trained by ``yaml/cpu_demo_moe.yaml`` (its experts reach the rollout engine through the same
weight stream)::

    python -m megatron_rl.demo --out .demo --moe
    torchrun --nproc_per_node=2 -m megatron_rl.train --config yaml/cpu_demo_moe.yaml

``--moe-arch deepseek_v3`` (or ``glm4_moe``, ``qwen2_moe``) writes ``OUT/model_deepseek_v3`` instead: the
same demo with a tiny DeepSeek-V3 (multi-latent attention, sigmoid routing with the expert-score bias,
grouped top-k, a shared expert, one dense layer first)::

    python -m megatron_rl.demo --out .demo --moe-arch deepseek_v3
    torchrun --nproc_per_node=2 -m megatron_rl.train --config yaml/cpu_demo_moe.yaml \
        actor_rollout_ref.model.path=.demo/model_deepseek_v3

Nothing is downloaded: the model (hidden 64, 2 layers) is initialised in code with HF's default
init, so the untrained policy is close to uniform and scores near chance on the toy task.
"""

from __future__ import annotations

import argparse
import os
import sys

# Tiny MoE actors of the demo (on top of its dense dims): 4 experts of width 64, top-2, about as many
# active parameters per token as the dense demo.
MOE_DEMOS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64
    ),
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        first_k_dense_replace=1,
        partial_rotary_factor=0.5,
        attention_bias=True,
        head_dim=16,
    ),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=64,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,  # multi-latent attention: every head its own key and value
        rope_scaling=None,
    ),
}


def prepare(
    out: str, seed: int = 0, reward_model: bool = False, moe: bool = False, moe_arch: str = "qwen3_moe"
) -> dict[str, str]:
    """The demo's model, tokenizer and data under ``out`` (kept if already there); with
    ``reward_model`` also a tiny reward model (``out/reward_model``) at the same layout, with ``moe``
    a tiny MoE actor of ``moe_arch`` (``out/model_moe`` for Qwen3-MoE, else ``out/model_<arch>``)."""
    from megatron_rl.demo.toy import build_toy_tokenizer, make_toy_dataset
    from megatron_rl.models.random_hf import save_random_hf_model

    model_dir = os.path.join(out, "model")
    data_dir = os.path.join(out, "data")
    tok = build_toy_tokenizer(model_dir)
    dims = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,  # TP=2 divides both models' heads (the reward model runs at the actor's TP)
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        save_random_hf_model(model_dir, "llama", seed=seed, init="hf", **dims)
    train, test = make_toy_dataset(data_dir, n_train=4096, n_test=256, seed=seed)
    paths = {"model": model_dir, "train": str(train), "test": str(test)}
    if reward_model:
        rm_dir = os.path.join(out, "reward_model")
        build_toy_tokenizer(rm_dir)
        if not os.path.isfile(os.path.join(rm_dir, "model.safetensors")):
            save_random_hf_model(rm_dir, "llama", seed=seed + 1, head="score", init="hf", **dims)
        paths["reward_model"] = rm_dir
    if moe:
        name = "model_moe" if moe_arch == "qwen3_moe" else f"model_{moe_arch}"
        moe_dir = os.path.join(out, name)
        build_toy_tokenizer(moe_dir)
        if not os.path.isfile(os.path.join(moe_dir, "model.safetensors")):
            save_random_hf_model(moe_dir, moe_arch, seed=seed, init="hf", **{**dims, **MOE_DEMOS[moe_arch]})
        paths[name] = moe_dir
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_rl.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default=".demo")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random model and the toy dataset")
    ap.add_argument(
        "--reward-model",
        action="store_true",
        help="also write OUT/reward_model, a tiny random reward model for trying reward_model.enable",
    )
    ap.add_argument(
        "--moe",
        action="store_true",
        help="also write OUT/model_moe, a tiny random Qwen3-MoE actor for yaml/cpu_demo_moe.yaml",
    )
    ap.add_argument(
        "--moe-arch",
        choices=sorted(MOE_DEMOS),
        default=None,
        help="the MoE actor's architecture (implies --moe): OUT/model_<arch> for yaml/cpu_demo_moe.yaml",
    )
    a = ap.parse_args()
    if not sys.stderr.isatty():  # transformers' save bars would land in a redirected log as frames
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    moe = a.moe or a.moe_arch is not None
    arch = a.moe_arch or "qwen3_moe"
    paths = prepare(a.out, seed=a.seed, reward_model=a.reward_model, moe=moe, moe_arch=arch)
    print(" ".join(f"{k}={v}" for k, v in paths.items()))
