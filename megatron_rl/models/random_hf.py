"""Random HF models built in code (no download): tiny ones for tests and the CPU demo, full-size
shapes (e.g. Qwen2.5-1.5B) for GPU benchmarks.

``head="score"`` gives the ``...ForSequenceClassification`` of the architecture instead (a reward
model: the trunk + ``score`` [num_labels=1, hidden], no bias; HF pools the last token that is not
``pad_token_id``, which the config sets).

``init="o1"`` gives O(1) activations: matrices ~ N(0, 1/fan_in), norm weights in [0.5, 1.5],
biases ~ N(0, 0.5). Unlike the usual 0.02 init, a wrong head order or gate/up split then changes
the logits by O(1), so layout bugs cannot hide in parity tests.
"""

from __future__ import annotations

import torch

ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
SEQ_CLS_CLASSES = {
    arch: f"{cfg[: -len('Config')]}ForSequenceClassification" for arch, (cfg, _) in ARCH_CLASSES.items()
}

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=99,  # odd on purpose: exercises vocabulary padding at TP=2
    max_position_embeddings=256,
)

# Mixture-of-experts dims on top of TINY: 4 experts, top-2, experts narrower than the dense MLP.
TINY_MOE: dict[str, dict] = {
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # a shared expert with its sigmoid gate; softmax top-k weights as they are (norm_topk_prob=False)
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
    ),
    # sigmoid routing with the expert-score bias, a shared expert, layer 0 dense, half-rotary heads,
    # q/k/v biases and q/k norms
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        head_dim=16,
    ),
    # multi-latent attention (q through a low-rank bottleneck), YaRN RoPE with mscale, grouped top-k
    # (4 groups of 2 experts, top-4 in the 2 best groups), a shared expert, layer 0 dense
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        num_key_value_heads=4,
        rope_scaling=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}

QWEN25_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)

# Qwen3-30B-A3B (arch qwen3_moe): 128 experts of 768, 8 per token, every layer MoE; ~30.5B parameters,
# ~3.3B active. intermediate_size is the (unused) dense MLP width of the HF config.
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)

# DeepSeek-V3 (arch deepseek_v3; Kimi-K2 has its layout with 384 experts): multi-latent attention (q rank
# 1536, kv rank 512), 256 routed experts of 2048 in 8 groups (top-8 from the 4 best groups), one shared
# expert, the first 3 of 61 layers dense; ~671B parameters, ~37B active.
DEEPSEEK_V3 = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    # fields of DeepSeek-V3's config.json that transformers' config class does not define (SGLang reads them)
    moe_layer_freq=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    vocab_size=129280,
    max_position_embeddings=163840,
    rope_theta=10000.0,
    rope_scaling=dict(
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    tie_word_embeddings=False,
)


def random_hf_model(
    arch: str, seed: int = 0, init: str = "o1", dtype=torch.float32, head: str = "lm", **dims
):
    """An HF ``*ForCausalLM`` (``head="lm"``) or ``*ForSequenceClassification`` (``head="score"``,
    num_labels=1 unless ``dims`` say otherwise) of ``arch`` with random weights; ``dims`` override
    :data:`TINY`."""
    import transformers

    if head not in ("lm", "score"):
        raise ValueError(f"head must be lm or score, got {head!r}")
    cfg_name, lm_name = ARCH_CLASSES[arch]
    cfg_cls = getattr(transformers, cfg_name)
    model_cls = getattr(transformers, lm_name if head == "lm" else SEQ_CLS_CLASSES[arch])
    kw = {**TINY, **TINY_MOE.get(arch, {}), **dims}
    if head == "score":
        kw.setdefault("num_labels", 1)
    kw.setdefault("tie_word_embeddings", False)
    if arch in ("qwen3", "qwen3_moe"):
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    if arch in ("mistral", "mixtral"):
        kw.setdefault("sliding_window", None)
    for key, default in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        kw.setdefault(key, default)
    config = cfg_cls(**kw)
    config._attn_implementation = "eager"
    # HF's own init draws from the global generator: seed it (without disturbing the caller's stream)
    # so that init="hf" models are reproducible too.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        model = model_cls(config).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if init != "o1":
                break
            if p.ndim >= 2:  # [out, in], or fused experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        if init == "o1":
            model.get_input_embeddings().weight.mul_(kw["hidden_size"] ** 0.5)  # embeddings ~ N(0, 1)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # of the order of the sigmoid scores
                    b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model.eval()


def save_random_hf_model(path: str, arch: str, seed: int = 0, head: str = "lm", **dims) -> str:
    """Save :func:`random_hf_model` as an HF directory (config.json + safetensors); returns ``path``."""
    model = random_hf_model(arch, seed=seed, head=head, **dims)
    model.save_pretrained(path)
    return path
