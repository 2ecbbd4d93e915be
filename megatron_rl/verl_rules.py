"""The table of verl's config keys that this project's config does not hold: one :class:`Rule` per
key pattern (alias, accepted-and-ignored, refused unless a value this project implements), the value
rewrites, verl's free-form maps and its Hydra config groups. :mod:`megatron_rl.verl_compat` applies
the table to a config layer and renders it as ``docs/verl_compat.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Rule:
    pattern: str
    """fnmatch pattern over the dotted key."""
    action: str
    """alias | ignored | refused | transformer (an override_transformer_config key kept, under
    ``*.megatron.override_transformer_config``, for megatron-core's TransformerConfig) | untrained (a
    training-only key on a forward-only model's section: ignored with verl's value, otherwise left
    for the loader's unknown-key error, which says where the key applies)"""
    why: str = ""
    """For ignored, refused and untrained keys: what this project does instead."""
    target: str = ""
    """For aliases: this project's key ('*' is replaced by what the pattern's '*' matched)."""
    allowed: tuple = ()
    """For refused keys: the values this project implements (accepted without a word); for untrained
    keys: the values verl's configs write there (accepted with a notice)."""


def _alias(pattern: str, target: str) -> Rule:
    return Rule(pattern, "alias", target=target)


def _ignored(pattern: str, why: str) -> Rule:
    return Rule(pattern, "ignored", why)


def _refused(pattern: str, why: str, *allowed: Any) -> Rule:
    return Rule(pattern, "refused", why, allowed=allowed)


def _untrained(pattern: str, *allowed: Any) -> Rule:
    return Rule(pattern, "untrained", FORWARD_ONLY, allowed=allowed)


FORWARD_ONLY = (
    "the reference and reward models run forward passes only: their megatron sections hold no gradient, "
    "optimizer or recompute keys"
)
NO_RAY = "one torchrun job, no Ray: placement comes from torchrun and the parallel sizes"
OWN_SCHEDULE = "the LR schedule is warmup + constant/cosine/linear decay over the run's optimizer steps"
OWN_LOADING = "weights load and save through this project's HF<->Megatron tables (torch_dist checkpoints)"
ENGINE_OWN = (
    "the in-process SGLang engine schedules its own batches (rollout.gpu_memory_utilization sizes it)"
)
NO_MULTIMODAL = "text-only models"
REPLAY_FROM_ENGINE = (
    "routing is replayed in memory, from the rollout engine (actor_rollout_ref.actor.router_replay.mode=R3) "
    "or the old-log-prob pass (R2), not from files"
)
REPLAY_ELSEWHERE = (
    "routing replay covers the actor's passes only (its old log-probs and updates, "
    "actor_rollout_ref.actor.router_replay.mode); the reference model routes with its own router"
)
REPLAY_FROM_R3 = (
    "the engine returns each token's routed experts whenever actor_rollout_ref.actor.router_replay.mode=R3, "
    "the one key that turns R3 on here"
)
MEGATRON_ONLY = "this trainer runs Megatron only"
NO_FUSIONS = "fused kernels follow transformer_impl: none on the local layers, TE's and jit ones on TE's"
ATTENTION = (
    "attention is torch SDPA (*.megatron.use_sdpa_attention) or megatron's local dot-product attention"
)
FROM_THE_MODEL = (
    "the TransformerConfig is built from the model's config.json and the parallel sizes; of "
    "override_transformer_config, recompute_*, transformer_impl, fp8, fp8_recipe, the MoE router losses and "
    "dtype and moe_grouped_gemm are used"
)
MOE_KERNELS = (
    "the MoE layers run megatron's top-k router as the model's config.json sets it (softmax, or sigmoid "
    "with the expert-score bias and grouped top-k; aux loss from moe_aux_loss_coeff), alltoall "
    "dispatcher and grouped-matmul experts (moe_grouped_gemm), without TE permute fusion or DeepEP"
)
MLA = "multi-latent attention follows the model's config.json (DeepseekV3ForCausalLM: kv_lora_rank, ...)"
UNEVEN_PP = (
    "pipelines split the decoder layers evenly, or by num_layers_in_first/last_pipeline_stage; a "
    "per-stage layout string and counting the embedding or the loss as layers are not implemented"
)
NO_DISTILLATION = "distillation is not implemented"
REMOVE_PADDING = (
    "verl's FSDP models read this key; Megatron models pack their sequences by "
    "*.megatron.use_remove_padding (on by default, as in verl)"
)

RULES: tuple[Rule, ...] = (
    # -- training-only keys that verl's configs write on the forward-only models' sections (before the
    # aliases: verl's ref inherits the actor's override_transformer_config, recompute_* included)
    _untrained("actor_rollout_ref.ref.megatron.grad_offload", False, None),
    _untrained("actor_rollout_ref.ref.megatron.optimizer_offload", False, None),
    _untrained("actor_rollout_ref.ref.megatron.use_distributed_optimizer", True, False, None),
    _untrained("reward_model.megatron.use_distributed_optimizer", True, False, None),
    _ignored("actor_rollout_ref.ref.megatron.override_transformer_config.recompute_*", FORWARD_ONLY),
    _ignored("reward_model.megatron.override_transformer_config.recompute_*", FORWARD_ONLY),
    # -- verl's engine choice and its override_transformer_config map (before the broad rules below)
    _refused("*model_engine", MEGATRON_ONLY, "megatron"),
    _alias(
        "*.megatron.override_transformer_config.recompute_granularity", "*.megatron.recompute_granularity"
    ),
    _alias(
        "actor_rollout_ref.actor.megatron.router_replay.mode", "actor_rollout_ref.actor.router_replay.mode"
    ),
    _refused("actor_rollout_ref.actor.*router_replay.re*_file", REPLAY_FROM_ENGINE, None),
    _alias("*.megatron.override_transformer_config.recompute_method", "*.megatron.recompute_method"),
    _alias("*.megatron.override_transformer_config.recompute_num_layers", "*.megatron.recompute_num_layers"),
    _alias("*.megatron.override_transformer_config.sequence_parallel", "*.megatron.sequence_parallel"),
    _alias("*.optim.override_optimizer_config.loss_scale", "*.optim.loss_scale"),
    _alias("*.optim.override_optimizer_config.initial_loss_scale", "*.optim.initial_loss_scale"),
    _alias("*.optim.override_optimizer_config.min_loss_scale", "*.optim.min_loss_scale"),
    _alias("*.optim.override_optimizer_config.loss_scale_window", "*.optim.loss_scale_window"),
    _alias("*.optim.override_optimizer_config.hysteresis", "*.optim.hysteresis"),
    _alias(
        "*.megatron.override_transformer_config.tensor_model_parallel_size",
        "*.megatron.tensor_model_parallel_size",
    ),
    _alias(
        "*.megatron.override_transformer_config.pipeline_model_parallel_size",
        "*.megatron.pipeline_model_parallel_size",
    ),
    _refused(
        "*.megatron.override_transformer_config.context_parallel_size",
        "context parallelism is not implemented",
        1,
        None,
    ),
    Rule("*.megatron.override_transformer_config.num_layers_in_first_pipeline_stage", "transformer"),
    Rule("*.megatron.override_transformer_config.num_layers_in_last_pipeline_stage", "transformer"),
    _refused("*.override_transformer_config.pipeline_model_parallel_layout", UNEVEN_PP, None),
    _refused("*.override_transformer_config.account_for_*_in_pipeline_split", UNEVEN_PP, False, None),
    _ignored("*.override_transformer_config.multi_latent_attention", MLA),
    Rule("*.megatron.override_transformer_config.recompute_modules", "transformer"),
    Rule("*.megatron.override_transformer_config.transformer_impl", "transformer"),
    Rule("*.megatron.override_transformer_config.fp8", "transformer"),
    Rule("*.megatron.override_transformer_config.fp8_recipe", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_aux_loss_coeff", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_z_loss_coeff", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_router_dtype", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_grouped_gemm", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_router_bias_update_rate", "transformer"),
    _ignored("*.override_transformer_config.moe_*", MOE_KERNELS),
    _ignored("*.override_transformer_config.*_fusion", NO_FUSIONS),
    _ignored("*.override_transformer_config.persist_layer_norm", NO_FUSIONS),
    _ignored("*.override_transformer_config.use_fused_*", NO_FUSIONS),
    _ignored("*.override_transformer_config.use_flash_attn", ATTENTION),
    _ignored("*.override_transformer_config.attention_backend", ATTENTION),
    _ignored("*.override_transformer_config.*", FROM_THE_MODEL),
    _ignored("*.use_remove_padding", REMOVE_PADDING),
    _ignored("*.megatron.forward_only", "set by the role: the ref and reward models run forward only"),
    # -- keys of verl's newer trainer config, and the "+" additions of its scripts
    _alias("reward.reward_kwargs.overlong_buffer_cfg.*", "reward_model.overlong_buffer.*"),
    _alias("reward_model.reward_kwargs.overlong_buffer_cfg.*", "reward_model.overlong_buffer.*"),
    _ignored("*.reward_kwargs.max_resp_len", "the overlong penalty counts from data.max_response_length"),
    _ignored(
        "actor_rollout_ref.rollout.moe_tensor_parallel_size",
        "SGLang derives it: tensor_model_parallel_size x data_parallel_size / expert_parallel_size",
    ),
    _alias("reward.custom_reward_function.*", "custom_reward_function.*"),
    _refused(
        "reward.reward_model.enable",
        "a reward model served by a rollout engine is not implemented; reward_model.enable runs a Megatron "
        "reward model in the trainer's processes",
        False,
    ),
    _refused("reward.reward_manager.module.path", "rewards go through custom_reward_function.path", None),
    _ignored("reward.*", "rewards go through custom_reward_function.path or the built-in rules"),
    _ignored("sandbox_fusion.*", "no code sandbox: code rewards go through custom_reward_function.path"),
    _refused("distillation.enabled", NO_DISTILLATION, False),
    _ignored("distillation.*", NO_DISTILLATION),
    _ignored("transfer_queue.*", NO_RAY),
    _refused("skip.*.enable", "every step generates", False),
    _ignored("skip.*", "every step generates"),
    _refused("*.qat.enable", "quantization-aware training is not implemented", False),
    _ignored("*.qat.*", "quantization-aware training is not implemented"),
    _ignored("*.entropy_from_logits_*", "the entropy comes from the vocabulary-parallel logit shards"),
    _ignored("*.calculate_sum_pi_squared", "no loss here uses the per-token sum of squared probabilities"),
    _ignored(
        "data.gen_batch_size",
        "each generation batch is data.train_batch_size prompts (partial rollouts keep "
        "actor_rollout_ref.rollout.partial_rollout_window batches in flight)",
    ),
    _ignored("data.function_tool_path", "set actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    _ignored("data.audio_key", NO_MULTIMODAL),
    _ignored("data.mm_processor_kwargs", NO_MULTIMODAL),
    _ignored("algorithm.filter_groups.max_inflight_gen_batches", "generation batches run one at a time"),
    # -- aliases: verl's name for a key this project has under another name
    _alias("*.megatron.dtype", "*.megatron.params_dtype"),
    _alias(
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    ),
    _alias("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    _alias("*.model.lora_rank", "*.model.lora.rank"),
    _alias("*.model.lora_alpha", "*.model.lora.alpha"),
    _alias("*.model.lora_adapter_path", "*.model.lora.adapter_path"),
    _alias("*.model.target_modules", "*.model.lora.target_modules"),
    _alias("*.model.exclude_modules", "*.model.lora.exclude_modules"),
    # -- refused unless the value is the one this project implements
    _refused("*.strategy", "this trainer runs Megatron only", "megatron"),
    _refused("*.megatron.context_parallel_size", "context parallelism is not implemented", 1, None),
    _refused("*.megatron.expert_model_parallel_size", "mixture-of-experts models are not supported", 1, None),
    _refused(
        "*.megatron.expert_tensor_parallel_size", "mixture-of-experts models are not supported", 1, None
    ),
    _refused("*.optim.optimizer", "the optimizer is megatron-core's Adam (AdamW)", "adam", "adamw"),
    _refused("*.lora.type", "adapters are plain LoRA (B @ A beside each target linear)", "lora"),
    _refused("*.lora.dropout_position", "dropout acts on the adapter's input", "pre"),
    _refused("*.lora.lora_B_init_method", "B starts at zero (the model starts as the base)", "zero"),
    _refused("*.lora.dtype", "adapters take the model's dtype (*.megatron.params_dtype)", None),
    _refused("*.lora.freeze_language_model", "the base weights are frozen whenever LoRA is on", True, None),
    _refused("*.mtp.enable*", "multi-token prediction is not implemented", False),
    _refused("actor_rollout_ref.model.tiled_mlp.enabled", "tiled MLPs are an FSDP feature", False),
    _refused(
        "actor_rollout_ref.model.custom_chat_template",
        "prompts use the tokenizer's own chat template (data.tokenizer)",
        None,
    ),
    _refused("actor_rollout_ref.model.external_lib", "no external model code is imported", None),
    _refused(
        "reward_model.use_dynamic_bsz",
        "the reward model runs micro-batches of reward_model.micro_batch_size_per_gpu sequences",
        False,
    ),
    _refused("*.ppo_micro_batch_size", "use ppo_micro_batch_size_per_gpu", None),
    _refused("*.log_prob_micro_batch_size", "use log_prob_micro_batch_size_per_gpu", None),
    _refused("reward_model.micro_batch_size", "use reward_model.micro_batch_size_per_gpu", None),
    _refused("actor_rollout_ref.rollout.pipeline_model_parallel_size", "the engine runs TP only", 1),
    _refused("actor_rollout_ref.rollout.quantization", "the engine holds the weights unquantized", None),
    _refused("actor_rollout_ref.rollout.skip_rollout", "every step generates", False),
    _refused("actor_rollout_ref.rollout.ignore_eos", "generation stops at the model's stop tokens", False),
    _refused("algorithm.use_pf_ppo", "preference-feedback PPO is not implemented", False),
    _refused(
        "algorithm.rollout_correction.bypass_mode",
        "the ratio's denominator is the trainer's recomputed log-prob, corrected by rollout_is / rollout_rs",
        False,
    ),
    _refused("data.custom_cls.path", "prompts load through megatron_rl.data (verl's parquet format)", None),
    _refused("data.sampler.class_path", "the sampler is megatron_rl.data's resumable one", None),
    _refused("data.datagen.path", "no dynamic data generation", None),
    _refused("reward_manager.module.path", "rewards go through custom_reward_function.path", None),
    _refused(
        "reward_model.rollout.name",
        "the reward model is a Megatron model in the trainer's processes (reward_model.megatron.*)",
        None,
        "???",
    ),
    _refused("transfer_queue.enable", NO_RAY, False),
    _refused("actor_rollout_ref.hybrid_engine", "actor and rollout always share the processes", True),
    # -- accepted and ignored, with what this project does instead
    _ignored("*._target_", "verl's Hydra class paths; the sections here are plain dataclasses"),
    _ignored("*profiler*", "no built-in profiler hooks; run under nsys or torch.profiler yourself"),
    _ignored("ray_kwargs.*", NO_RAY),
    _ignored("trainer.ray_wait_register_center_timeout", NO_RAY),
    _ignored("trainer.use_legacy_worker_impl", NO_RAY),
    _ignored("*.nccl_timeout", "trainer.dist_timeout_minutes sets every collective's timeout"),
    _ignored("*.load_weight", "models always load their weights"),
    _ignored("*.rollout_n", "derived from actor_rollout_ref.rollout.n"),
    _ignored("*.optim.*", OWN_SCHEDULE),
    _refused(
        "*.megatron.use_megatron_fsdp",
        "megatron-core's FSDP is not offered: parameters are sharded by tensor/pipeline/expert parallelism "
        "and the optimizer state over data-parallel ranks by *.megatron.use_distributed_optimizer",
        False,
    ),
    _ignored("*.megatron.*", OWN_LOADING),
    _ignored("*.checkpoint.*", "checkpoints always hold model, optimizer and RNG/sampler state"),
    _ignored("*.router_replay.*", REPLAY_ELSEWHERE),
    _ignored("*.lora.freeze_vision_*", NO_MULTIMODAL),
    _ignored("*.lora.a2a_experimental", "routed experts take their adapters inside the grouped experts"),
    _ignored("*.mtp*", "multi-token prediction is not implemented"),
    _ignored("reward_model.forward_max_token_len_per_gpu", "reward_model.use_dynamic_bsz is not implemented"),
    _ignored("*.use_torch_compile", "megatron-core modules run eagerly"),
    _ignored("*.use_fused_kernels", "megatron-core's local layer spec is used"),
    _ignored("*.fused_kernel_options.*", "megatron-core's local layer spec is used"),
    _ignored("*.use_liger", "an FSDP-only kernel library"),
    _ignored("*.use_shm", "models load from their directory"),
    _ignored("*.override_config*", OWN_LOADING),
    _ignored("*.hf_config_path", "config.json is read from the model directory"),
    _ignored(
        "*.megatron.seed",
        "actor_rollout_ref.actor.megatron.seed seeds the job; the other models load their weights",
    ),
    _ignored("*.external_lib", "no external model code is imported"),
    _ignored("*.enable_activation_offload", "use model.enable_gradient_checkpointing and the *_offload keys"),
    _ignored("*.data_loader_seed", "data.seed seeds the sampler"),
    _ignored("*.freeze_vision_tower", NO_MULTIMODAL),
    _ignored("*.tiled_mlp.*", "tiled MLPs are an FSDP feature"),
    _ignored("actor_rollout_ref.actor.policy_loss.*", "policy_loss.loss_mode selects the loss"),
    _ignored("actor_rollout_ref.actor.calculate_entropy", "the entropy is always computed and logged"),
    _ignored("actor_rollout_ref.actor.use_prefix_grouper", "not implemented"),
    _ignored("actor_rollout_ref.rollout.mode", "generation runs in process, synchronously"),
    _ignored("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length"),
    _ignored("actor_rollout_ref.rollout.response_length", "data.max_response_length"),
    _ignored("actor_rollout_ref.rollout.logprobs_mode", "old log-probs are recomputed by the actor"),
    _ignored(
        "actor_rollout_ref.rollout.load_format", "the engine starts empty and receives the actor's weights"
    ),
    _ignored("actor_rollout_ref.rollout.skip_tokenizer_init", "the engine always works on token ids"),
    _ignored("actor_rollout_ref.rollout.layer_name_map.*", OWN_LOADING),
    _ignored("actor_rollout_ref.rollout.checkpoint_engine.*", "weights stream through the reshard module"),
    _refused(
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
        "the training sequence is the token ids the engine saw and produced",
        False,
    ),
    _ignored(
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
        "turns are never re-tokenised: the token ids are kept as generated",
    ),
    _ignored("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "actor_rollout_ref.rollout.n"),
    _ignored("actor_rollout_ref.rollout.multi_turn.*", "no such setting of the multi-turn loop"),
    _ignored(
        "actor_rollout_ref.rollout.agent.*",
        "one agent loop (megatron_rl.rollout.agent.agent_loop), set by "
        "actor_rollout_ref.rollout.multi_turn.*",
    ),
    _ignored("actor_rollout_ref.rollout.trace.*", "no rollout tracing"),
    _ignored("actor_rollout_ref.rollout.prometheus.*", "no metrics server; metrics go to trainer.logger"),
    _ignored("actor_rollout_ref.rollout.skip_dump_dir", "every step generates"),
    _ignored(
        "actor_rollout_ref.rollout.quantization_config_file", "the engine holds the weights unquantized"
    ),
    _ignored("actor_rollout_ref.rollout.enable_rollout_routing_replay", REPLAY_FROM_R3),
    _ignored("actor_rollout_ref.rollout.engine_kwargs.*", ENGINE_OWN),
    _ignored("actor_rollout_ref.rollout.*", ENGINE_OWN),
    _ignored("data.image_*", NO_MULTIMODAL),
    _ignored("data.video_key", NO_MULTIMODAL),
    _ignored("data.return_multi_modal_inputs", NO_MULTIMODAL),
    _ignored("data.custom_cls.*", "prompts load through megatron_rl.data"),
    _ignored("data.sampler.*", "the sampler is megatron_rl.data's resumable one"),
    _ignored("data.datagen.*", "no dynamic data generation"),
    _ignored("data.return_*", "the batch always holds token ids, masks and the chat prompt"),
    _ignored("data.dataloader_num_workers", "prompts are tokenized once, up front"),
    _ignored("data.filter_overlong_prompts_workers", "prompts are tokenized once, up front"),
    _ignored("data.use_shm", "prompts load from their files"),
    _ignored("data.*_max_samples", "every row of the files is used"),
    _ignored("data.reward_fn_key", "the data_source column picks the reward rule"),
    _ignored("data.tool_config_path", "set actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    _ignored("data.validation_shuffle", "validation runs over every prompt once"),
    _ignored("data.trust_remote_code", "actor_rollout_ref.model.trust_remote_code"),
    _ignored("data.apply_chat_template_kwargs", "the tokenizer's chat template is applied as it is"),
    _ignored("reward_manager.*", "rewards go through custom_reward_function.path or the built-in rules"),
    _ignored(
        "reward_model.*",
        "the reward model runs in the trainer's processes at the actor's layout (reward_model.megatron.*)",
    ),
    _ignored("critic.model.*", OWN_LOADING),
    _ignored("algorithm.rollout_correction.*", "used by verl's bypass mode only, which is not implemented"),
    _ignored("algorithm.pf_ppo.*", "preference-feedback PPO is not implemented"),
    _ignored("algorithm.kl_ctrl.*", "not used by the fixed/adaptive controllers here"),
    _ignored("trainer.max_critic_ckpt_to_keep", "trainer.max_ckpt_to_keep keeps whole checkpoints"),
    _ignored("trainer.log_val_generations", "validation logs scores, not generations"),
    _ignored("trainer.rollout_data_dir", "rollouts are not dumped"),
    _ignored("trainer.validation_data_dir", "validation generations are not dumped"),
    _ignored("trainer.esi_redundant_time", "checkpoints are saved every trainer.save_freq steps"),
    _ignored("trainer.del_local_ckpt_after_load", "checkpoints are kept (trainer.max_ckpt_to_keep prunes)"),
    _ignored(
        "trainer.balance_batch",
        "the data.train_batch_size x rollout.n samples are split evenly over data-parallel ranks in batch "
        "order (verl's rule: the samples, not the prompts, must divide; a prompt's samples may span ranks), "
        "not reordered by length",
    ),
    _ignored("trainer.ray_*", NO_RAY),
    _ignored("trainer.*", "not used by this trainer"),
    _ignored("global_profiler.*", "no built-in profiler hooks"),
)


# Values of this project's own keys that verl command lines use and that mean the same thing here.
VALUE_REWRITES = {
    ("actor_rollout_ref.rollout.name", "vllm"): (
        "sglang",
        "vLLM is not bundled; the in-process SGLang engine generates",
    ),
}


# verl's free-form maps and the keys its scripts add with Hydra's "+": keys under these are verl's too.
VERL_FREE_FORM = (
    "ray_kwargs.*",
    "*.megatron.override_transformer_config.*",
    "*.megatron.override_ddp_config.*",
    "*.megatron.override_mcore_model_config.*",
    "*.optim.override_optimizer_config.*",
    "*.override_config.*",
    "*.engine_kwargs.*",
    "*.model_engine",  # verl's scripts set actor_rollout_ref.actor.model_engine beside model_engine
    "reward.reward_kwargs.*",
    "reward_model.reward_kwargs.*",
    "actor_rollout_ref.rollout.moe_tensor_parallel_size",
)

# verl's Hydra config groups (the defaults list of its ppo_megatron_trainer.yaml / ppo_trainer.yaml):
# "group@package=choice" -> the choices that mean what this trainer runs. The sections here always
# hold the defaults of verl's Megatron trainer (but for DEFAULT_DIFFERENCES).
HYDRA_GROUPS: dict[str, tuple[str, ...]] = {
    "actor@actor_rollout_ref.actor": ("megatron_actor",),
    "ref@actor_rollout_ref.ref": ("megatron_ref",),
    "critic@critic": ("megatron_critic",),
    "rollout@actor_rollout_ref.rollout": ("rollout",),
    "model@actor_rollout_ref.model": ("hf_model",),
    "model@critic.model": ("hf_model",),
    "data@data": ("legacy_data",),
    "reward_model@reward_model": ("megatron_reward_loop", "megatron_reward_model", "reward_model"),
    "reward_manager@reward_manager": ("reward_manager",),
    "reward@reward": ("reward",),
    "algorithm@algorithm.rollout_correction": ("rollout_correction",),
    "distillation@distillation": ("distillation",),
    "transfer_queue@transfer_queue": ("transfer_queue",),
}

# verl's own base configs (Hydra's --config-name): their defaults are this trainer's, but for
# DEFAULT_DIFFERENCES.
VERL_BASE_CONFIGS = ("ppo_megatron_trainer", "ppo_trainer")


class DefaultDifference(NamedTuple):
    here: Any
    """This project's default, as its config section writes it."""
    why: str
    """Why this project keeps it instead of verl's."""


ACTOR, REF, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout"
AUTO_OFFLOAD = "auto: the memory planner offloads only when the rollout engine would not fit otherwise"
EXAMPLE = "verl's value is its GSM8K example's; here it is set per run"
MICRO_BATCH = "verl leaves it unset (required unless use_dynamic_bsz); here a working default"
LAYOUT = "null: the actor's (all models share one parallel layout); verl's 1 is fixed"
RECOMPUTE = "used only with model.enable_gradient_checkpointing; verl's null (no recompute) is that flag off"
OWN_MAP = "its own map: the actor's may hold training-only keys; set moe_* here too"
BOTH_CLIPS = "null: clip_ratio, so that clip_ratio alone sets both sides (verl's 0.2 ignores it)"
CKPT_DIR = "names the checkpoint directory: a new name would hide existing runs' checkpoints"
TORCHRUN = "null: torchrun's; a value set here is checked against it"
TRAINED_OFFLOADS = ("param_offload", "grad_offload", "optimizer_offload")
LAYOUT_KEYS = ("tensor", "pipeline", "expert")
RECOMPUTE_DEFAULTS = (
    ("recompute_granularity", "full"),
    ("recompute_method", "uniform"),
    ("recompute_num_layers", 1),
)
_D = DefaultDifference

# Keys of both configs whose default here is not verl's (verl_defaults.json, from verl's source):
# this project's key -> its default and why. tests/unit/test_verl_defaults.py checks the list.
DEFAULT_DIFFERENCES: dict[str, DefaultDifference] = {
    **{f"{m}.megatron.{k}": _D("auto", AUTO_OFFLOAD) for m in (ACTOR, "critic") for k in TRAINED_OFFLOADS},
    **{f"{m}.megatron.param_offload": _D("auto", AUTO_OFFLOAD) for m in (REF, "reward_model")},
    **{f"{ACTOR}.megatron.{k}_model_parallel_size": _D(None, "null: 1, as verl's") for k in LAYOUT_KEYS},
    **{
        f"{m}.megatron.{k}_model_parallel_size": _D(None, LAYOUT)
        for m in ("critic", "reward_model")
        for k in LAYOUT_KEYS
    },
    **{f"{m}.megatron.{k}": _D(v, RECOMPUTE) for m in (ACTOR, "critic") for k, v in RECOMPUTE_DEFAULTS},
    **{f"{m}.megatron.override_transformer_config": _D({}, OWN_MAP) for m in (REF, "reward_model")},
    **{
        f"{m}.megatron.use_remove_padding": _D(
            None, "null: the section's use_sdpa_attention (true, as verl's; the local attention cannot pack)"
        )
        for m in (ACTOR, "critic")
    },
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": _D(4, MICRO_BATCH),
    f"{REF}.log_prob_micro_batch_size_per_gpu": _D(8, MICRO_BATCH),
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": _D(8, MICRO_BATCH),
    "critic.ppo_micro_batch_size_per_gpu": _D(4, MICRO_BATCH),
    "reward_model.micro_batch_size_per_gpu": _D(8, MICRO_BATCH),
    f"{ACTOR}.clip_ratio_low": _D(None, BOTH_CLIPS),
    f"{ACTOR}.clip_ratio_high": _D(None, BOTH_CLIPS),
    f"{ROLLOUT}.name": _D("sglang", "verl requires a choice; SGLang is the GPU engine here (hf for CPU)"),
    f"{ROLLOUT}.dtype": _D(None, "null: the actor's megatron.params_dtype (an fp16 policy samples in fp16)"),
    f"{ROLLOUT}.tensor_model_parallel_size": _D(1, "1 runs on any GPU count and on CPU; 2 needs two GPUs"),
    f"{ROLLOUT}.update_weights_bucket_megabytes": _D(512, "each bucket is GPU memory beside the KV cache"),
    "actor_rollout_ref.model.path": _D("", EXAMPLE),
    "actor_rollout_ref.model.enable_gradient_checkpointing": _D(
        False, "verl's Megatron workers do not read it (no recompute unless recompute_* are set): as false"
    ),
    "data.train_files": _D([], EXAMPLE),
    "data.val_files": _D([], EXAMPLE),
    "data.seed": _D(1, "a seeded prompt order repeats and resumes; verl's null leaves the sampler unseeded"),
    "critic.model.path": _D("", "empty: the actor's model.path (verl's is its example's path)"),
    "critic.shuffle": _D(False, "its own setting here (not derived from the actor's): set both"),
    "critic.loss_agg_mode": _D("token-mean", "its own setting here (not derived from the actor's): set both"),
    "reward_model.model.input_tokenizer": _D(None, "null: data.tokenizer, which encoded the responses"),
    "reward_model.model.path": _D("", EXAMPLE),
    "trainer.total_epochs": _D(1, EXAMPLE + " (one pass unless set)"),
    "trainer.project_name": _D("megatron_rl", CKPT_DIR),
    "trainer.experiment_name": _D("ppo", CKPT_DIR),
    "trainer.logger": _D(["console"], "wandb needs an account and the network: opt in"),
    "trainer.nnodes": _D(None, TORCHRUN),
    "trainer.n_gpus_per_node": _D(None, TORCHRUN),
    "trainer.device": _D("auto", "auto runs on CPU too (cuda when available)"),
}
