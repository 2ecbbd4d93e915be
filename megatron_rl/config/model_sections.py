"""The model sections of the config: weights (model paths), the optimizer, and the megatron sections
of the trained models (:class:`MegatronConfig`) and of the forward-only ones
(:class:`FrozenMegatronConfig`). The rollout sections are in :mod:`megatron_rl.config.rollout_sections`,
the others in :mod:`megatron_rl.config.schema`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megatron_rl.config.lora import LoraConfig


@dataclass
class CriticModelConfig:
    path: str = ""
    """Critic trunk: HF directory or Megatron checkpoint; defaults to the actor's model (it reads the
    actor's tokens, so its vocabulary must be the actor's)."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (critic.megatron.recompute_* shape it)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the critic's trunk (the value head always trains)."""


@dataclass
class ModelConfig:
    path: str = ""
    """HF model directory, torch_dist checkpoint or legacy Megatron-LM checkpoint (auto-detected)."""
    tokenizer_path: str | None = None
    """Tokenizer directory if it is not beside the weights."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the tokenizer."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (megatron's recompute, shaped by the model's
    megatron.recompute_* keys) instead of keeping them: less memory, about one more forward."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the actor (its reference model is then the actor without them)."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of a decaying schedule."""
    lr_warmup_steps: int = -1
    """Linear warmup steps; -1 derives them from lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup length as a fraction of the total optimizer steps (used when lr_warmup_steps < 0)."""
    lr_decay_style: str = "constant"
    """Schedule after warmup: constant | cosine | linear."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and norms)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over all TP/PP/DP shards) to this value; 0 disables."""
    stochastic_rounding: bool = True
    """bf16 models: round the fp32 main weights into the bf16 parameters stochastically (unbiased)
    instead of to nearest, so that updates smaller than half a bf16 ulp (RL learning rates: most of
    them) still move the policy; seeded by (actor.megatron.seed, the optimizer, its step), so a resumed run
    rounds as the uninterrupted one. No effect on fp32 models; fp16 rounds to nearest."""
    loss_scale: float | None = None
    """fp16 models: a fixed loss scale; None = megatron's dynamic scaler (the keys below)."""
    initial_loss_scale: float = 65536.0
    """fp16: the dynamic loss scale's start (2^16). An overflow skips that update and is logged as
    actor|critic/loss_scale_skips, never as a failure."""
    min_loss_scale: float = 1.0
    """fp16: the dynamic scale's floor; an overflow at the floor counts as a non-finite step
    (trainer.max_nonfinite_steps)."""
    loss_scale_window: int = 1000
    """fp16: optimizer steps without an overflow before the scale doubles."""
    hysteresis: int = 2
    """fp16: overflows in a row before the scale halves (each one still skips its update)."""


@dataclass
class FrozenMegatronConfig:
    """The megatron section of a model that runs forward passes only (the reference and the reward
    model): its parallel layout, dtype, attention and weight offload. The keys that shape training
    (gradients, the optimizer, recomputation in the backward pass) are :class:`MegatronConfig`'s."""

    tensor_model_parallel_size: int | None = None
    """Tensor-parallel size; None: 1 for the actor, the actor's for ref and critic (they must match)."""
    pipeline_model_parallel_size: int | None = None
    """Pipeline-parallel size; None: 1 for the actor, the actor's for ref and critic (they must match)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B; needs PP > 1 and must divide each stage's
    layers); None: 1 for the actor, the actor's for ref, critic and reward model (they must match)."""
    expert_model_parallel_size: int | None = None
    """Mixture-of-experts models: ranks the experts are distributed over (whole experts; must divide
    the experts and world / (PP x expert_tensor_parallel_size)); None: 1 for the actor, the actor's
    for ref and critic. No effect on a dense model."""
    expert_tensor_parallel_size: int | None = None
    """Mixture-of-experts models: ranks each expert's matrices are split over; None: the
    tensor-parallel size (megatron's default)."""
    params_dtype: str = "bfloat16"
    """Parameter dtype of the Megatron model: float32 | bfloat16 | float16 (float32 on CPU)."""
    use_sdpa_attention: bool = True
    """Use torch's scaled_dot_product_attention as the core attention (fused, same math)."""
    use_remove_padding: bool | None = None
    """Pack each micro-batch's sequences into one row (megatron's THD layout): no padding token reaches
    attention, the MLP or the LM head, and the token budget of use_dynamic_bsz counts real tokens.
    Needs use_sdpa_attention. None: the section's use_sdpa_attention for the actor and the critic
    (packed whenever it can be), the actor's value for the reference and reward models."""
    param_offload: bool | str = "auto"
    """Hold this model's weights in host memory while the rollout engine generates (the actor's after
    the weight sync); they return to the GPU before the next training phase. true | false | auto (the
    memory planner parks them only if the engine would not fit otherwise: run/memory_plan.py)."""
    sequence_parallel: bool = True
    """With TP > 1: split norms, dropout and residuals along the sequence over the TP ranks (less
    activation memory, reduce-scatter/all-gather instead of all-reduce). Ignored at TP = 1."""
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    """verl's megatron-core TransformerConfig overrides that change what runs here, kept as
    TransformerConfig keyword arguments: recompute_modules (selective recompute) and moe_* (router
    dtype, token dispatcher, grouped GEMM, aux losses; MoE models only). The other keys verl's scripts
    set here are aliased (recompute_*, sequence_parallel) or accepted with a notice (verl_compat)."""

    # Not keys: a forward-only model never recomputes. The model builder reads these of any model's
    # megatron section (so this class types all of them); MegatronConfig makes them keys (fields).
    @property
    def recompute_granularity(self) -> str | None:
        """Recompute granularity: None (a forward-only model does not recompute)."""
        return None

    @property
    def recompute_method(self) -> str:
        """Full recompute's method: uniform (a forward-only model does not recompute)."""
        return "uniform"

    @property
    def recompute_num_layers(self) -> int:
        """Full recompute's layers per chunk: 1 (a forward-only model does not recompute)."""
        return 1


@dataclass
class MegatronConfig(FrozenMegatronConfig):
    """The megatron section of a trained model (the critic; the actor's adds the job's seed): the
    frozen keys plus those of gradients, the optimizer and recomputation."""

    grad_offload: bool | str = "auto"
    """Free the gradient buckets while the rollout engine generates (zeroed before each update anyway).
    true | false | auto (the memory planner decides)."""
    optimizer_offload: bool | str = "auto"
    """Hold AdamW's moments and the fp32 master weights in host memory while the rollout engine generates.
    true | false | auto (the memory planner decides; parked first: the cheapest to bring back)."""
    use_distributed_optimizer: bool = True
    """Shard the fp32 master weights and Adam's moments over the data-parallel ranks (megatron's
    distributed optimizer, ZeRO-1): optimizer memory per GPU falls as 1/DP. Its checkpoints resume at
    any DP size; a run resumes only with the setting it was saved with."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket over DP as soon as the backward pass has filled it."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather updated parameters during the next forward pass."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 (bf16/fp16 models); off halves the gradient buffers."""
    recompute_granularity: str = "full"
    """With model.enable_gradient_checkpointing: full (whole layers) | selective (attention core only)."""
    recompute_method: str = "uniform"
    """Full recompute: uniform (every layer, in chunks of recompute_num_layers) | block (the first
    recompute_num_layers layers of each pipeline stage)."""
    recompute_num_layers: int = 1
    """Full recompute: layers per chunk (uniform) or recomputed layers per stage (block)."""


@dataclass
class ActorMegatronConfig(MegatronConfig):
    seed: int = 42
    """Seed of megatron's RNG streams (the model-parallel and data-parallel streams: weight init, dropout)
    and of bf16 stochastic rounding; the other models load their weights and draw nothing. A model
    loaded from its weights, without dropout, in fp32 draws nothing from it. The rollout's sampling is
    seeded by actor_rollout_ref.rollout.seed, the prompt order by data.seed."""


TRAINED_ONLY_KEYS: frozenset[str] = frozenset(
    f.name for f in fields(MegatronConfig) if f.name not in {g.name for g in fields(FrozenMegatronConfig)}
)
"""Keys of a trained model's megatron section that a frozen one does not have (grad_offload, ...)."""

TRAINED_MEGATRON_SECTIONS = ("actor_rollout_ref.actor.megatron", "critic.megatron")
"""The megatron sections of the trained models, where :data:`TRAINED_ONLY_KEYS` apply."""
