"""verl's config keys that this project's config does not hold: aliases, accepted-and-ignored keys and
refused values, so that a verl command line runs unchanged or fails in one line saying why.

:func:`translate` is applied by :func:`megatron_rl.config.load_config` to every layer (YAML file,
command line) before the layer is checked against the dataclasses: an alias is renamed to this
project's key, an ignored key is dropped with a notice, a refused key passes only with the value
this project implements (verl's default, usually). A key that neither verl nor this project knows
still fails with a did-you-mean: the rules apply to verl's keys only (``verl_keys.txt``, the keys of
verl's Megatron PPO trainer config, old and new) and the free-form maps and "+" additions of
verl's scripts (``VERL_FREE_FORM``). ``docs/verl_compat.md`` is this table, key by key
(``python -m megatron_rl.verl_docs > docs/verl_compat.md``).

Hydra's habits: a config-group choice ``group@package=choice`` (:data:`HYDRA_GROUPS`) is handled in
:func:`translate`; ``--config-path/--config-name`` by :func:`hydra_config_args`, which the entry points
(``megatron_rl.train``, ``python -m megatron_rl.config``) apply before parsing their arguments.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from dataclasses import dataclass
from typing import Any

from megatron_rl.dotted import leaves


@dataclass(frozen=True)
class Rule:
    pattern: str
    """fnmatch pattern over the dotted key."""
    action: str
    """alias | ignored | refused | transformer (an override_transformer_config key kept, under
    ``*.megatron.override_transformer_config``, for megatron-core's TransformerConfig)"""
    why: str = ""
    """For ignored and refused keys: what this project does instead."""
    target: str = ""
    """For aliases: this project's key ('*' is replaced by what the pattern's '*' matched)."""
    allowed: tuple = ()
    """For refused keys: the values this project implements (accepted without a word)."""


def _alias(pattern: str, target: str) -> Rule:
    return Rule(pattern, "alias", target=target)


def _ignored(pattern: str, why: str) -> Rule:
    return Rule(pattern, "ignored", why)


def _refused(pattern: str, why: str, *allowed: Any) -> Rule:
    return Rule(pattern, "refused", why, allowed=allowed)


NO_RAY = "one torchrun job, no Ray: placement comes from torchrun and the parallel sizes"
OWN_SCHEDULE = "the LR schedule is warmup + constant/cosine/linear decay over the run's optimizer steps"
OWN_LOADING = "weights load and save through this project's HF<->Megatron tables (torch_dist checkpoints)"
ENGINE_OWN = (
    "the in-process SGLang engine schedules its own batches (rollout.gpu_memory_utilization sizes it)"
)
NO_MULTIMODAL = "text-only models"
MEGATRON_ONLY = "this trainer runs Megatron only"
NO_FUSIONS = "megatron-core's local layer spec runs here, without Transformer Engine / Apex fused kernels"
ATTENTION = (
    "attention is torch SDPA (*.megatron.use_sdpa_attention) or megatron's local dot-product attention"
)
FROM_THE_MODEL = (
    "the TransformerConfig is built from the model's config.json and the parallel sizes; of "
    "override_transformer_config, recompute_* and the MoE router losses and dtype are used"
)
MOE_KERNELS = (
    "the MoE layers run megatron's top-k softmax router (aux loss from moe_aux_loss_coeff), alltoall "
    "dispatcher and SequentialMLP experts, without TE permute fusion, grouped GEMM or DeepEP"
)
UNEVEN_PP = "uneven pipeline stages are not implemented (the layers are split evenly over the stages)"
NO_DISTILLATION = "distillation is not implemented"
REMOVE_PADDING = (
    "padding is removed without a flag: with use_dynamic_bsz each micro-batch is compacted (real tokens "
    "first, cut to its longest sequence); sequences are not packed into one row"
)

RULES: tuple[Rule, ...] = (
    # -- verl's engine choice and its override_transformer_config map (before the broad rules below)
    _refused("model_engine", MEGATRON_ONLY, "megatron"),
    _refused("*.model_engine", MEGATRON_ONLY, "megatron"),
    _alias(
        "*.megatron.override_transformer_config.recompute_granularity", "*.megatron.recompute_granularity"
    ),
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
    _refused("*.override_transformer_config.num_layers_in_*_pipeline_stage", UNEVEN_PP, None),
    _refused("*.override_transformer_config.pipeline_model_parallel_layout", UNEVEN_PP, None),
    _refused("*.override_transformer_config.account_for_*_in_pipeline_split", UNEVEN_PP, False, None),
    _refused(
        "*.override_transformer_config.multi_latent_attention",
        "multi-latent attention is not implemented",
        False,
    ),
    Rule("*.megatron.override_transformer_config.recompute_modules", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_aux_loss_coeff", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_z_loss_coeff", "transformer"),
    Rule("*.megatron.override_transformer_config.moe_router_dtype", "transformer"),
    _ignored("*.override_transformer_config.moe_*", MOE_KERNELS),
    _ignored("*.override_transformer_config.*_fusion", NO_FUSIONS),
    _ignored("*.override_transformer_config.persist_layer_norm", NO_FUSIONS),
    _ignored("*.override_transformer_config.use_fused_*", NO_FUSIONS),
    _ignored("*.override_transformer_config.use_flash_attn", ATTENTION),
    _ignored("*.override_transformer_config.attention_backend", ATTENTION),
    _ignored("*.override_transformer_config.*", FROM_THE_MODEL),
    _ignored("*.use_remove_padding", REMOVE_PADDING),
    _ignored(
        "*.megatron.forward_only",
        "set by the role: the reference and reward models run forward only, the actor and critic train",
    ),
    # -- keys of verl's newer trainer config, and the "+" additions of its scripts
    _alias("reward.reward_kwargs.overlong_buffer_cfg.*", "reward_model.overlong_buffer.*"),
    _alias("reward_model.reward_kwargs.overlong_buffer_cfg.*", "reward_model.overlong_buffer.*"),
    _ignored("*.reward_kwargs.max_resp_len", "the overlong penalty counts from data.max_response_length"),
    _ignored(
        "actor_rollout_ref.rollout.moe_tensor_parallel_size",
        "the engine's layout is actor_rollout_ref.rollout.tensor_model_parallel_size",
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
    _ignored(
        "*.entropy_from_logits_*",
        "the entropy is computed from the vocabulary-parallel logit shards, unchunked",
    ),
    _ignored("*.calculate_sum_pi_squared", "no loss here uses the per-token sum of squared probabilities"),
    _ignored("data.gen_batch_size", "each generation batch is data.train_batch_size prompts"),
    _ignored("data.function_tool_path", "set actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    _ignored("data.audio_key", NO_MULTIMODAL),
    _ignored("data.mm_processor_kwargs", NO_MULTIMODAL),
    _ignored(
        "critic.loss_scale_factor", "the critic's seq-mean-token-sum-norm divides by the response width"
    ),
    _ignored("algorithm.filter_groups.max_inflight_gen_batches", "generation batches run one at a time"),
    # -- aliases: verl's name for a key this project has under another name
    _alias("*.megatron.dtype", "*.megatron.params_dtype"),
    _alias(
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    ),
    _alias("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    # -- refused unless the value is the one this project implements
    _refused("*.strategy", "this trainer runs Megatron only", "megatron"),
    _refused("*.megatron.context_parallel_size", "context parallelism is not implemented", 1, None),
    _refused("*.megatron.expert_model_parallel_size", "mixture-of-experts models are not supported", 1, None),
    _refused(
        "*.megatron.expert_tensor_parallel_size", "mixture-of-experts models are not supported", 1, None
    ),
    _refused(
        "*.megatron.virtual_pipeline_model_parallel_size",
        "interleaved pipeline stages are not implemented",
        1,
        None,
    ),
    _refused("*.optim.optimizer", "the optimizer is megatron-core's Adam (AdamW)", "adam", "adamw"),
    _refused("*lora*rank", "LoRA is not implemented", 0, None),
    _refused("actor_rollout_ref.model.lora_adapter_path", "LoRA is not implemented", None),
    _refused("*.lora.adapter_path", "LoRA is not implemented", None),
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
    _refused("actor_rollout_ref.rollout.data_parallel_size", "one engine per rollout TP group", 1),
    _refused(
        "actor_rollout_ref.rollout.expert_parallel_size",
        "the engine runs tensor parallelism only (its experts are split over its TP ranks)",
        1,
    ),
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
    _ignored("*.megatron.*", OWN_LOADING),
    _ignored("*.checkpoint.*", "checkpoints always hold model, optimizer and RNG/sampler state"),
    _ignored("*.router_replay.*", "routing replay is not implemented: the trainer's router routes"),
    _ignored("*.lora*", "LoRA is not implemented"),
    _ignored("*lora_alpha", "LoRA is not implemented"),
    _ignored("*.target_modules", "LoRA is not implemented"),
    _ignored("*.exclude_modules", "LoRA is not implemented"),
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
        "one agent loop (megatron_rl.rollout.agent_loop), set by actor_rollout_ref.rollout.multi_turn.*",
    ),
    _ignored("actor_rollout_ref.rollout.trace.*", "no rollout tracing"),
    _ignored("actor_rollout_ref.rollout.prometheus.*", "no metrics server; metrics go to trainer.logger"),
    _ignored("actor_rollout_ref.rollout.skip_dump_dir", "every step generates"),
    _ignored(
        "actor_rollout_ref.rollout.quantization_config_file", "the engine holds the weights unquantized"
    ),
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
    _ignored("trainer.balance_batch", "prompts are split evenly over data-parallel ranks"),
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
# hold the defaults of verl's Megatron trainer.
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

# verl's own base configs (Hydra's --config-name): their defaults are this trainer's.
VERL_BASE_CONFIGS = ("ppo_megatron_trainer", "ppo_trainer")


def hydra_config_args(argv: list[str], notices: list[str]) -> list[str]:
    """``argv`` with Hydra's ``--config-path P`` / ``--config-name N`` (either ``=`` or space form)
    replaced by ``--config P/N.yaml``. verl's own base configs (``ppo_megatron_trainer``,
    ``ppo_trainer``: Hydra compositions of verl's config groups, named from verl's source tree) are
    dropped with a notice instead: this config's defaults are verl's Megatron trainer's. A file that is
    not there fails in the loader, as a missing --config file does."""
    out, path, name, i = [], None, None, 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, val = arg.partition("=")
        if flag in ("--config-path", "--config-name", "-cp", "-cn"):
            if not eq:
                val = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            if flag in ("--config-path", "-cp"):
                path = val
            else:
                name = val
        else:
            out.append(arg)
        i += 1
    if name is None:
        if path is not None:
            notices.append(f"--config-path={path} is ignored: no --config-name names a file in it.")
        return out
    stem = name[:-5] if name.endswith(".yaml") else name
    file = os.path.join(path or ".", stem + ".yaml")
    if os.path.basename(stem) in VERL_BASE_CONFIGS:  # a Hydra composition of verl's, not a config file
        notices.append(
            f"--config-name={name}: verl's {stem}.yaml; this trainer's defaults are those of verl's "
            "Megatron trainer config (a YAML file of your own goes in --config)."
        )
        return out
    return ["--config", file, *out]


def _group_choice(key: str, value: Any, source: str, notices: list[str]) -> None:
    """A Hydra config-group choice (``actor@actor_rollout_ref.actor=megatron_actor``): accepted with a
    notice when it names what this trainer runs; ValueError otherwise."""
    allowed = HYDRA_GROUPS.get(key)
    if allowed is None:
        raise ValueError(
            f"{key}={value!r} (from {source}): not one of verl's config groups "
            f"({', '.join(sorted(HYDRA_GROUPS))})."
        )
    if value not in allowed:
        raise ValueError(
            f"{key}={value!r} (from {source}): {MEGATRON_ONLY}, with verl's Megatron trainer defaults "
            f"(accepted: {', '.join(allowed)})."
        )
    notices.append(f"{key}={value} is accepted: the section holds verl's Megatron trainer defaults.")


@functools.cache
def verl_key_list() -> tuple[str, ...]:
    """The keys of verl's Megatron PPO trainer config, in its order (verl_keys.txt beside this module)."""
    with open(os.path.join(os.path.dirname(__file__), "verl_keys.txt")) as f:
        return tuple(line.strip() for line in f if line.strip())


@functools.cache
def verl_keys() -> frozenset[str]:
    return frozenset(verl_key_list())


def is_verl_key(key: str) -> bool:
    """``key`` is in verl's config, or lies under one of its free-form maps (``override_*``, ...)."""
    parts = key.split(".")
    if any(".".join(parts[:i]) in verl_keys() for i in range(len(parts), 0, -1)):
        return True
    return any(fnmatch.fnmatchcase(key, p) for p in VERL_FREE_FORM)


def rule_for(key: str) -> Rule | None:
    """The first rule whose pattern matches ``key``."""
    return next((r for r in RULES if fnmatch.fnmatchcase(key, r.pattern)), None)


def _set(d: dict, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    for p in path:
        d = d.setdefault(p, {})
    d[leaf] = value


def translate(raw: dict, known: set[str], source: str, notices: list[str]) -> dict:
    """``raw`` with verl-only keys handled (module docstring); keys this project knows pass through.

    Raises ValueError (one line, naming the key and why) for a refused value. Appends one notice
    per ignored key to ``notices``.
    """
    out: dict = {}
    for key, value in leaves(raw):
        if isinstance(value, str) and (key, value) in VALUE_REWRITES:
            value, why = VALUE_REWRITES[key, value]
            notices.append(f"{key}: {why}.")
        if "@" in key.split(".", 1)[0]:  # a Hydra group choice: "group@package.path=choice"
            _group_choice(key, value, source, notices)
            continue
        rule = None if key in known or not is_verl_key(key) else rule_for(key)
        if rule is None or rule.action == "transformer":  # transformer: kept in the free-form map
            _set(out, key, value)
        elif rule.action == "alias":
            # "*.megatron.dtype" -> "*.megatron.params_dtype": the section the '*' matched carries over
            target = rule.target
            if "*" in target:  # the key's part that the pattern's one '*' matched carries over
                head, tail = rule.pattern.split("*", 1)
                target = target.replace("*", key[len(head) : len(key) - len(tail)])
            _set(out, target, value)
        elif rule.action == "refused":
            if value not in rule.allowed:
                allowed = ", ".join(repr(a) for a in rule.allowed) or "none"
                raise ValueError(f"{key}={value!r} (from {source}): {rule.why} (accepted: {allowed}).")
        else:
            notices.append(f"{key} is accepted and ignored: {rule.why}.")
    return out


def compat_table(verl_keys: list[str], known: set[str]) -> str:
    """docs/verl_compat.md: every verl key with what this project does with it."""
    rows = {"implemented": [], "alias": [], "refused": [], "ignored": [], "unclassified": []}
    for key in verl_keys:
        if key in known:
            rows["implemented"].append(f"| `{key}` | same key |")
            continue
        rule = rule_for(key)
        if rule is None:
            rows["unclassified"].append(f"| `{key}` | |")
        elif rule.action == "alias":
            rows["alias"].append(f"| `{key}` | read as `{rule.target}` |")
        elif rule.action == "refused":
            ok = ", ".join(f"`{a}`" for a in rule.allowed) or "none"
            rows["refused"].append(f"| `{key}` | accepted: {ok}; otherwise refused: {rule.why} |")
        elif rule.action == "transformer":
            rows["implemented"].append(f"| `{key}` | passed to megatron-core's TransformerConfig |")
        else:
            rows["ignored"].append(f"| `{key}` | {rule.why} |")
    titles = {
        "implemented": "Implemented under verl's name",
        "alias": "Implemented under another name",
        "refused": "Accepted only with the value this project implements",
        "ignored": "Accepted and ignored (a one-line notice at start names each one set)",
        "unclassified": "Not classified (refused as unknown keys)",
    }
    out = [
        "# verl config keys",
        "",
        "Every key of verl's Megatron PPO trainer config (v0.7's `ppo_megatron_trainer.yaml` and the",
        "newer `model_engine=megatron` composition) and what megatron-rl does with it. Keys that",
        "neither verl nor megatron-rl knows fail with a did-you-mean. A scalar given for a list key",
        "(`data.train_files=x.parquet`, `trainer.logger=console`) is a one-element list, and `+key=value`",
        "sets `key` like `key=value`. Generated by `python -m megatron_rl.verl_docs` from the key list",
        "in `megatron_rl/verl_keys.txt`.",
        "",
    ]
    for name, title in titles.items():
        if rows[name]:
            out += [f"## {title} ({len(rows[name])})", "", "| key | here |", "| --- | --- |", *rows[name], ""]
    return "\n".join(out + _hydra_section() + _transformer_section())


def _hydra_section() -> list[str]:
    groups = [f"| `{g}` | {', '.join(f'`{c}`' for c in choices)} |" for g, choices in HYDRA_GROUPS.items()]
    return [
        "## verl's Hydra habits",
        "",
        "- `model_engine=megatron` and `actor_rollout_ref.actor.model_engine=megatron` are accepted;",
        f"  any other engine is refused ({MEGATRON_ONLY}).",
        "- `--config-path P --config-name N` (or `=` forms) load `P/N.yaml` when it exists. verl's own",
        f"  base configs ({', '.join(f'`{c}`' for c in VERL_BASE_CONFIGS)}) are dropped with a notice:",
        "  this config's defaults are verl's Megatron trainer's.",
        "- `+key=value` sets `key` like `key=value`, for this config's keys, verl's keys and the keys",
        "  verl's scripts add with `+` (`trainer.val_only`, `override_transformer_config.*`, ...).",
        "- Config-group choices (`group@package=choice`): the choice that means what this trainer runs is",
        "  accepted with a notice, any other refused in one line.",
        "",
        "| group@package | accepted |",
        "| --- | --- |",
        *groups,
        "",
    ]


def _transformer_section() -> list[str]:
    prefix = "*.megatron.override_transformer_config."
    rows = []
    for r in RULES:
        if not r.pattern.startswith(
            ("*.megatron.override_transformer_config.", "*.override_transformer_config.")
        ):
            continue
        key = r.pattern.split("override_transformer_config.", 1)[1]
        if r.action == "alias":
            here = f"read as `{r.target}`"
        elif r.action == "refused":
            ok = ", ".join(f"`{a}`" for a in r.allowed) or "none"
            here = f"accepted: {ok}; otherwise refused: {r.why}"
        elif r.action == "transformer" and key.startswith("moe_"):
            here = "kept: read by the MoE layers' router (MoE models only)"
        elif r.action == "transformer":
            here = "kept: passed to megatron-core's TransformerConfig"
        else:
            here = f"accepted and ignored: {r.why}"
        rows.append(f"| `{key}` | {here} |")
    return [
        f"## `{prefix}*` (first matching row)",
        "",
        "Kept keys land in the section's `megatron.override_transformer_config` map.",
        "",
        "| key | here |",
        "| --- | --- |",
        *rows,
        "",
    ]
