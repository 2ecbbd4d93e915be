"""Model dimensions from an HF ``config.json``: the one description every other module builds from."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# HF architecture class -> our architecture key (a table in megatron_rl.weights.tables).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    """Key of the HF<->Megatron table: llama | mistral | qwen2 | qwen3 | phi3."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The original config.json, written back unchanged when exporting to HF."""

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up so that it splits evenly over ``tp`` ranks (padding rows are 0)."""
        return -(-self.vocab_size // tp) * tp

    def num_params(self) -> int:
        h, f, hd = self.hidden_size, self.ffn_hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h


def model_args_from_hf_config(hf: dict) -> ModelArgs:
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"Unsupported HF architecture {archs}; supported: {sorted(HF_ARCHITECTURES)}. "
            "Check 'architectures' in the model's config.json."
        )
    # transformers 5 keeps RoPE settings under rope_parameters; older configs use rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} is not supported (rope_parameters in config.json).")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (config.json of the model).")
    if arch != "qwen2" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ValueError(f"{archs}: attention_bias/mlp_bias are not supported (config.json of the model).")
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    rope_theta = hf.get("rope_theta") or rope.get("rope_theta", 10000.0)
    return ModelArgs(
        arch=arch,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope_theta),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hf_config=hf,
    )


def load_model_args(path: str) -> ModelArgs:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(
            f"{cfg_file} not found: actor_rollout_ref.model.path must be an HF model directory"
        )
    with open(cfg_file) as f:
        return model_args_from_hf_config(json.load(f))
