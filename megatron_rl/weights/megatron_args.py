"""Megatron-LM's saved training args <-> :class:`~megatron_rl.model_args.ModelArgs`.

A legacy (or torch_dist) checkpoint without an HF config.json still describes its model in the
``args`` Namespace Megatron-LM saves: :func:`model_args_from_megatron_args` maps the Llama-family ones
to an HF config; :func:`megatron_args_from_model_args` writes that Namespace for the checkpoints we save.
"""

from __future__ import annotations

import argparse

import torch

from megatron_rl.errors import ModelRefused
from megatron_rl.model_args import HF_ARCHITECTURES, LLAMA3_FIXED, ModelArgs, model_args_from_hf_config

_ARCH_CLASS = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}


def hf_config_for(
    arch: str,
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_position_embeddings: int,
    rope_theta: float,
    norm_eps: float,
    tie_embeddings: bool,
    dtype: str = "float32",
) -> dict:
    """An HF config.json (as a dict) for a Llama-family architecture with these dimensions."""
    cfg = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": ffn_hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rms_norm_eps": norm_eps,
        "tie_word_embeddings": tie_embeddings,
        "hidden_act": "silu",
        "dtype": dtype,
    }
    if arch != "qwen2":
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def model_args_from_megatron_args(ns: argparse.Namespace, source: str) -> ModelArgs:
    """Map the ``args`` Namespace that Megatron-LM saves in its checkpoints to :class:`ModelArgs`.

    Only Llama-family GPT models map (RMSNorm, SwiGLU, RoPE, no linear biases); anything else
    raises a ValueError naming the offending argument and ``source``.
    """

    def get(*names, default=None):
        for n in names:
            v = getattr(ns, n, None)
            if v is not None:
                return v
        return default

    def refuse(what: str) -> ModelRefused:
        return ModelRefused(
            f"{source}: the saved Megatron-LM args describe {what}, which megatron-rl cannot map to an HF "
            "architecture. Put the model's HF config.json beside the checkpoint if it is a Llama/Qwen model."
        )

    for field in ("num_layers", "hidden_size", "num_attention_heads"):
        if get(field) is None:
            raise refuse(f"no {field}")
    if get("num_experts", "num_moe_experts"):
        raise refuse("a mixture of experts (num_experts)")
    if get("multi_latent_attention", default=False):
        raise refuse("multi-latent attention")
    pos = get("position_embedding_type", default="rope" if get("use_rotary_position_embeddings") else None)
    if pos != "rope":
        raise refuse(f"position_embedding_type={pos!r} (need rope)")
    if get("rotary_percent", default=1.0) != 1.0:
        raise refuse("partial RoPE (rotary_percent)")
    if get("rotary_interleaved", default=False):
        raise refuse("interleaved RoPE")
    if get("normalization", default="LayerNorm") != "RMSNorm" or get("apply_layernorm_1p", default=False):
        raise refuse(f"normalization={get('normalization')!r} (need RMSNorm)")
    if not (get("swiglu", default=False) or get("gated_linear_unit", default=False)):
        raise refuse("an MLP without SwiGLU")
    add_bias = get("add_bias_linear")
    if add_bias is None and getattr(ns, "disable_bias_linear", None) is not None:
        add_bias = not ns.disable_bias_linear
    if add_bias:
        raise refuse("biases in the linear layers (add_bias_linear)")
    qkv_bias, qk_norm = bool(get("add_qkv_bias", default=False)), bool(get("qk_layernorm", default=False))
    if qkv_bias and qk_norm:
        raise refuse("both q/k/v biases and q/k layernorm")
    arch = "qwen2" if qkv_bias else "qwen3" if qk_norm else "llama"
    heads, hidden = ns.num_attention_heads, ns.hidden_size
    kv = get("num_query_groups", default=heads) if get("group_query_attention", default=False) else heads
    # The tensors hold padded_vocab_size rows (Megatron-LM pads for TP); HF configs of Llama/Qwen
    # models carry padded sizes too, so the exported model keeps them all.
    vocab = get("padded_vocab_size", "vocab_size")
    if vocab is None:
        raise refuse("no vocabulary size (padded_vocab_size)")
    dtype = get("params_dtype", default=torch.float32)
    dtype_name = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else "float32"
    hf = hf_config_for(
        arch,
        num_layers=ns.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=get("ffn_hidden_size", default=4 * hidden),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=get("kv_channels", default=hidden // heads),
        vocab_size=vocab,
        max_position_embeddings=get("max_position_embeddings", "seq_length", default=4096),
        rope_theta=float(get("rotary_base", default=10000)),
        norm_eps=float(get("norm_epsilon", "layernorm_epsilon", default=1e-5)),
        tie_embeddings=not get("untie_embeddings_and_output_weights", default=False),
        dtype=dtype_name,
    )
    if get("use_rope_scaling", default=False):  # megatron's scaling is Llama 3.x's, factor aside
        factor = float(get("rope_scaling_factor", default=8.0))
        hf["rope_parameters"].update(rope_type="llama3", factor=factor, **LLAMA3_FIXED)
    return model_args_from_hf_config(hf, source)


def megatron_args_from_model_args(
    args: ModelArgs, tp: int, pp: int, padded_vocab_size: int, dtype: torch.dtype, iteration: int = 0
) -> argparse.Namespace:
    """The subset of Megatron-LM's training args that describes the model, as Megatron-LM saves it.

    ``vocab_size`` is left None, as when Megatron-LM derives it from the tokenizer.
    """
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_heads,
        group_query_attention=args.num_kv_heads != args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        seq_length=args.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=args.rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        normalization="RMSNorm",
        norm_epsilon=args.norm_eps,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        untie_embeddings_and_output_weights=not args.tie_embeddings,
        vocab_size=None,
        padded_vocab_size=padded_vocab_size,
        make_vocab_size_divisible_by=128,
        num_experts=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        ckpt_format="torch",
        use_mcore_models=True,
        transformer_impl="local",
        attention_backend=AttnBackend.auto,
        iteration=iteration,
    )
