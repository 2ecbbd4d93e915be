"""Model dimensions from an HF ``config.json``: the one description every other module builds from.

The leaf of the package's import graph (it imports nothing from megatron_rl): weight tables,
checkpoint readers, model builders and rollout engines all describe a model by :class:`ModelArgs`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from megatron_rl.errors import ModelRefused

# Parameter / rollout dtype names in the config -> torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_dtype(name: str, device: torch.device | str) -> str:
    """The dtype a model or engine runs in on ``device``: ``name`` (``*.megatron.params_dtype``,
    ``rollout.dtype``) on a GPU, float32 on CPU (CPU kernels have no bf16 speed-up, and CPU runs are
    the exact references of the tests)."""
    return "float32" if torch.device(device).type == "cpu" else name


# HF architecture class -> our architecture key (a table in megatron_rl.weights.tables).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Architectures recognised but refused: the class -> the piece this trainer does not build.
REFUSED_ARCHITECTURES = {
    "GptOssForCausalLM": (
        "its attention sinks (a learned per-head logit in the softmax) have no counterpart in "
        "megatron-core 0.16.1's local attention, and its clamped SwiGLU experts with biases none in its "
        "MoE layers"
    ),
}
# Mixture-of-experts architectures (ModelArgs.num_experts > 0).
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3")
# HF sequence-classification classes (reward models): the same trunk with a ``score`` linear head
# [num_labels, hidden] instead of the LM head (transformers' GenericForSequenceClassification).
HF_SEQ_CLS_ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "Phi3ForSequenceClassification": "phi3",
}


@dataclass(frozen=True)
class MLADims:
    """Multi-latent attention (DeepSeek-V2/V3): queries through a low-rank ``q_lora_rank`` bottleneck
    (or one projection when None), keys and values from one ``kv_lora_rank`` latent shared by all heads
    plus a ``qk_rope_head_dim`` rotary key shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class YarnRope:
    """YaRN RoPE scaling (``rope_type: yarn``) as megatron-core's YarnRotaryEmbedding takes it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    """Key of the HF<->Megatron table: llama | mistral | qwen2 | qwen3 | phi3 | qwen3_moe | mixtral |
    qwen2_moe | glm4_moe | deepseek_v3."""
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
    rope_scaling: bool = False
    """Llama 3.x RoPE scaling (``rope_type: llama3``) with megatron-core's fixed low/high frequency
    factors 1 and 4 and original context 8192; ``rope_scaling_factor`` is its ``factor``."""
    rope_scaling_factor: float = 8.0
    yarn: YarnRope | None = None
    """YaRN RoPE scaling (DeepSeek-V3's ``rope_scaling``); multi-latent attention only."""
    sliding_window: int | None = None
    """The attention window HF applies (each token sees the last ``sliding_window`` tokens), or None.
    Our attention is full causal: see :func:`check_sliding_window`."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    moe_top_k: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one expert's SwiGLU MLP."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k softmax probabilities to sum to 1 (Mixtral always; Qwen3-MoE's
    ``norm_topk_prob``). False: the top-k of the softmax over all experts, as they are."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True for an MoE layer, False for a dense MLP of ``ffn_hidden_size`` (Qwen3-MoE's
    ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek-V3's ``first_k_dense_replace``); empty for a
    dense model."""
    moe_shared_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert every token also passes through (0: none). DeepSeek-V3
    and GLM-4.5: ``n_shared_experts * moe_intermediate_size``; Qwen2-MoE:
    ``shared_expert_intermediate_size``."""
    moe_shared_expert_gate: bool = False
    """Qwen2-MoE: the shared expert's output is scaled by sigmoid(x . gate) ([1, hidden] weight)."""
    moe_score_function: str = "softmax"
    """softmax | sigmoid (DeepSeek-V3 / GLM-4.5 ``scoring_func``: per-expert sigmoid, top-k weights
    renormalised)."""
    moe_expert_bias: bool = False
    """The router carries ``e_score_correction_bias`` [E] (fp32): added to the scores to choose experts,
    not to weigh them; trained by the auxiliary-loss-free balancing update, not by gradients."""
    moe_num_groups: int = 0
    """Grouped top-k (``n_group``): experts form this many groups and each token picks its experts in its
    ``moe_group_topk`` best groups (0: no grouping)."""
    moe_group_topk: int = 0
    """Groups each token may route to (``topk_group``)."""
    moe_routed_scaling: float = 1.0
    """``routed_scaling_factor``: the routed experts' weights are multiplied by it."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (GLM-4.5's ``partial_rotary_factor``)."""
    mla: MLADims | None = None
    """Multi-latent attention (DeepSeek-V3) dims; None for grouped-query attention."""
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The original config.json, written back unchanged when exporting to HF."""

    @property
    def is_sequence_classifier(self) -> bool:
        """True for an HF ``...ForSequenceClassification`` (reward model: ``score`` head, no LM head)."""
        return any(a in HF_SEQ_CLS_ARCHITECTURES for a in self.hf_config.get("architectures") or [])

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up so that it splits evenly over ``tp`` ranks (padding rows are 0)."""
        return -(-self.vocab_size // tp) * tp

    @property
    def attention_head_dim(self) -> float:
        """A head's width in attention's FLOPs: the mean of its query-key and value widths (the head
        dim, or multi-latent attention's nope + rope and v dims)."""
        m = self.mla
        return self.head_dim if m is None else (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2

    def attention_params(self) -> int:
        """Weights of one attention block (matrices only)."""
        h, m = self.hidden_size, self.mla
        if m is None:
            return h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = self.num_heads * qk * (h if m.q_lora_rank is None else m.q_lora_rank)
        q += 0 if m.q_lora_rank is None else h * m.q_lora_rank
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv += m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + self.num_heads * m.v_head_dim * h

    def num_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        total = 0
        for i in range(self.num_layers):
            if self.is_moe_layer(i):
                mlp = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h)  # experts + router rows
                mlp += 3 * h * self.moe_shared_ffn_hidden_size
            else:
                mlp = 3 * h * f
            total += self.attention_params() + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total + emb + h

    def num_active_params(self) -> int:
        """Parameters a token passes through: top-k experts of each MoE layer (all of a dense model)."""
        if not self.is_moe:
            return self.num_params()
        idle = self.num_experts - self.moe_top_k
        moe = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        return self.num_params() - moe * idle * 3 * self.hidden_size * self.moe_ffn_hidden_size


# megatron-core's RotaryEmbedding applies Llama 3.x scaling with these values fixed; only the
# factor is a parameter (GPTModel(rope_scaling=True, rope_scaling_factor=...)).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# HF's default sliding_window per architecture when config.json does not name one.
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096}


def _rope_scaling(hf: dict, where: str) -> tuple[bool, float]:
    """(rope_scaling, rope_scaling_factor) for megatron-core, or a ValueError naming the field."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return False, 8.0
    if rope_type != "llama3":
        raise ModelRefused(
            f"{where}: {key}.rope_type={rope_type!r} is not supported (supported: default, llama3); "
            "the model's positions would be encoded differently than it was trained with."
        )
    for name, fixed in LLAMA3_FIXED.items():
        if name not in rope:
            raise ModelRefused(f"{where}: {key}.{name} is missing (llama3 RoPE scaling needs it).")
        if float(rope[name]) != fixed:
            raise ModelRefused(
                f"{where}: {key}.{name}={rope[name]} is not supported; megatron-core's llama3 RoPE "
                f"scaling fixes it at {fixed:g}."
            )
    factor = float(rope.get("factor", 0.0))
    if factor <= 0:
        raise ModelRefused(f"{where}: {key}.factor={rope.get('factor')!r} must be a positive number.")
    return True, factor


def _sliding_window(hf: dict, arch: str, num_layers: int) -> int | None:
    """The window HF's modelling code applies for this config, None when attention is full causal."""
    window = hf.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(arch))
    if window is None or arch == "llama":
        return None
    if arch in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        if not hf.get("use_sliding_window", False):
            return None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = hf.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if "sliding_attention" not in layer_types:
            return None
    return int(window)


def model_args_from_hf_config(hf: dict, source: str | None = None) -> ModelArgs:
    """``source`` (the model's path) names the model in errors; the architecture does otherwise."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in REFUSED_ARCHITECTURES:
            raise ModelRefused(f"{source or a}: {a} is not supported: {REFUSED_ARCHITECTURES[a]}.")
    known = {**HF_ARCHITECTURES, **HF_SEQ_CLS_ARCHITECTURES}
    arch = next((known[a] for a in archs if a in known), None)
    if arch is None:
        raise ModelRefused(
            f"Unsupported HF architecture {archs}; supported: {sorted(known)}. "
            "Check 'architectures' in the model's config.json."
        )
    where = source or "/".join(archs)
    if any(a in HF_SEQ_CLS_ARCHITECTURES for a in archs):
        # HF writes num_labels as id2label, and leaves it out at its default of 2; a reward model's
        # score head has exactly one output.
        labels = hf.get("num_labels", len(hf.get("id2label") or {0: None, 1: None}))
        if labels != 1:
            raise ModelRefused(
                f"{where}: a sequence classifier with num_labels={labels}; a reward model needs a scalar "
                "score head (num_labels=1, score.weight [1, hidden])."
            )
    # transformers 5 keeps RoPE settings under rope_parameters; older configs use rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    mla = _mla_dims(hf, where) if arch == "deepseek_v3" else None
    yarn = None
    if mla is not None and rope.get("rope_type", rope.get("type")) == "yarn":
        yarn = _yarn(rope)
        rope_scaling, rope_scaling_factor = False, 8.0
    else:
        rope_scaling, rope_scaling_factor = _rope_scaling(hf, where)
    rotary_percent = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if rotary_percent != 1.0 and arch != "glm4_moe":
        raise ModelRefused(
            f"{where}: partial_rotary_factor != 1 is not supported for {arch} (config.json of the model)."
        )
    biases = arch in ("qwen2", "qwen2_moe", "glm4_moe")  # q/k/v biases (o_proj has none)
    if hf.get("mlp_bias") or (hf.get("attention_bias") and not biases):
        raise ModelRefused(f"{where}: attention_bias/mlp_bias are not supported (config.json of the model).")
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    rope_theta = hf.get("rope_theta") or rope.get("rope_theta", 10000.0)
    moe = _moe_fields(hf, arch, where) if arch in MOE_ARCHS else {}
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
        qkv_bias=arch == "qwen2"
        or (arch == "qwen2_moe" and hf.get("qkv_bias", True))
        or (arch == "glm4_moe" and bool(hf.get("attention_bias"))),
        qk_norm=arch in ("qwen3", "qwen3_moe") or (arch == "glm4_moe" and bool(hf.get("use_qk_norm"))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor,
        yarn=yarn,
        sliding_window=_sliding_window(hf, arch, hf["num_hidden_layers"]),
        rotary_percent=rotary_percent,
        mla=mla,
        hf_config=hf,
        **moe,
    )


def _moe_fields(hf: dict, arch: str, where: str) -> dict:
    """The ModelArgs MoE fields of a Qwen3-MoE / Mixtral config.json (refusing what is not built)."""
    n = hf["num_hidden_layers"]
    # Qwen3-MoE's Hub files say num_experts; transformers 5 writes num_local_experts (Mixtral's name).
    experts = hf.get("num_local_experts", hf.get("num_experts", hf.get("n_routed_experts")))
    top_k = hf.get("num_experts_per_tok", 2)
    if not experts or not 0 < top_k <= experts:
        raise ModelRefused(
            f"{where}: num_experts={experts}, num_experts_per_tok={top_k} is not an MoE layout."
        )
    if arch == "mixtral":
        return dict(
            num_experts=experts,
            moe_top_k=top_k,
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_norm_topk_prob=True,
            moe_layers=(True,) * n,
        )
    if arch in ("glm4_moe", "deepseek_v3"):
        return _sigmoid_moe_fields(hf, where, experts, top_k)
    shared = 0
    if hf.get("shared_expert_intermediate_size"):
        if arch != "qwen2_moe":
            raise ModelRefused(
                f"{where}: shared_expert_intermediate_size on a {arch} model: transformers' "
                "Qwen3MoeForCausalLM has no shared expert, so this file's own modelling code differs; "
                "a Qwen2-MoE-style shared expert is read from a Qwen2MoeForCausalLM config."
            )
        shared = int(hf["shared_expert_intermediate_size"])
    dense = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    return dict(
        num_experts=experts,
        moe_top_k=top_k,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=layers,
        moe_shared_ffn_hidden_size=shared,
        moe_shared_expert_gate=shared > 0,
    )


def _sigmoid_moe_fields(hf: dict, where: str, experts: int, top_k: int) -> dict:
    """DeepSeek-V3 / GLM-4.5 MoE: sigmoid scores with the expert-score bias (``noaux_tc``), grouped
    top-k, scaled weights, a shared expert and ``first_k_dense_replace`` dense layers first."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ModelRefused(
            f"{where}: scoring_func={hf.get('scoring_func')!r}, topk_method={hf.get('topk_method')!r}; "
            "supported: sigmoid with noaux_tc (DeepSeek-V3's routing)."
        )
    if not hf.get("norm_topk_prob", True) and top_k > 1:
        raise ModelRefused(
            f"{where}: norm_topk_prob=false with sigmoid scores: megatron-core always renormalises the "
            "top-k sigmoid weights."
        )
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    if groups > 1 and (experts % groups or top_k % group_topk or top_k // group_topk != 2):
        raise ModelRefused(
            f"{where}: n_group={groups}, topk_group={group_topk} with {experts} experts, top-{top_k}: "
            "a group is scored by its 2 best experts in transformers and by num_experts_per_tok / "
            "topk_group in megatron-core; supported when those agree (num_experts_per_tok = 2 * topk_group)."
        )
    n, first_dense = hf["num_hidden_layers"], int(hf.get("first_k_dense_replace", 0))
    freq = int(hf.get("moe_layer_freq", 1))
    return dict(
        num_experts=experts,
        moe_top_k=top_k,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_norm_topk_prob=True,
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(n)),
        moe_shared_ffn_hidden_size=int(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=groups if groups > 1 else 0,
        moe_group_topk=group_topk if groups > 1 else 0,
        moe_routed_scaling=float(hf.get("routed_scaling_factor") or 1.0),
    )


def _mla_dims(hf: dict, where: str) -> MLADims:
    if not hf.get("rope_interleave", True):
        raise ModelRefused(
            f"{where}: rope_interleave=false: megatron-core's multi-latent attention rotates the "
            "interleaved rotary dims of DeepSeek's checkpoints only."
        )
    missing = [
        k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if k not in hf
    ]
    if missing:
        raise ModelRefused(f"{where}: {', '.join(missing)} missing: multi-latent attention needs them.")
    return MLADims(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
    )


def _yarn(rope: dict) -> YarnRope:
    return YarnRope(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        mscale=float(rope.get("mscale", 1.0)),
        mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
    )


def check_sliding_window(args: ModelArgs, max_seq_len: int | None = None, source: str | None = None) -> None:
    """Refuse a model whose sliding window a run can exceed: our attention is full causal.

    Full causal attention equals a window of ``n`` tokens as long as no sequence is longer than
    ``n``. ``max_seq_len`` is the longest sequence the run builds (prompt + response); None checks
    against the model's ``max_position_embeddings``.
    """
    n = args.sliding_window
    limit = args.max_position_embeddings if max_seq_len is None else max_seq_len
    if n is None or limit <= n:
        return
    where = source or "/".join(args.hf_config.get("architectures") or [args.arch])
    seen = f"max_position_embeddings={limit}" if max_seq_len is None else f"sequences of up to {limit} tokens"
    raise ModelRefused(
        f"{where}: sliding_window={n} (attention limited to the last {n} tokens) is not implemented; "
        f"this trainer's attention is full causal, which differs from the model's past {n} tokens "
        f"({seen}). Keep data.max_prompt_length + data.max_response_length <= {n}, and set "
        "sliding_window to null in config.json if you accept that."
    )


def load_model_args(path: str) -> ModelArgs:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(
            f"{cfg_file} not found: actor_rollout_ref.model.path must be an HF model directory"
        )
    with open(cfg_file) as f:
        return model_args_from_hf_config(json.load(f), source=path)
