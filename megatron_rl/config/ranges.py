"""Every numeric config key's range, and the check that applies them (config.checks.validate runs it
first): one line naming the first key outside its range and the range it must be in."""

from __future__ import annotations

import math
from typing import Any

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import known_keys
from megatron_rl.config.schema import Config

# Every numeric key's range (fnmatch patterns over the dotted key; None values pass: "unset").
# ">0" / ">=1" / "[0,1]" / "(0,1]" / "any"; tests/unit/test_config.py checks that every numeric key has one.
RANGES: dict[str, str] = {
    "data.max_prompt_length": ">=1",
    "data.max_response_length": ">=1",
    "data.train_batch_size": ">=1",
    "data.val_batch_size": ">=1",
    "data.seed": "any",
    # any integer: sample_seed hashes it modulo 2**64, SGLang's engine seed is taken modulo 2**31
    "actor_rollout_ref.rollout.seed": "any",
    "*.ppo_mini_batch_size": ">=1",
    "*.ppo_micro_batch_size_per_gpu": ">=1",
    "*.log_prob_micro_batch_size_per_gpu": ">=1",
    "*max_token_len_per_gpu": ">=1",
    "*.ppo_epochs": ">=1",
    "actor_rollout_ref.rollout.engine_restarts": ">=0",
    "actor_rollout_ref.actor.clip_ratio": ">0",
    "actor_rollout_ref.actor.clip_ratio_[hl]*": ">=0",  # _high, _low
    "actor_rollout_ref.actor.clip_ratio_c": ">1",
    "actor_rollout_ref.actor.loss_scale_factor": ">0",
    "critic.loss_scale_factor": ">0",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio": "[0,1]",
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb": "any",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub": "any",
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": "[0,1]",
    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": ">=0",
    "actor_rollout_ref.actor.tau_*": ">0",
    "actor_rollout_ref.actor.entropy_coeff": "any",
    "actor_rollout_ref.actor.kl_loss_coef": ">=0",
    "*.optim.lr": ">=0",
    "*.optim.min_lr": ">=0",
    "*.optim.lr_warmup_steps": ">=-1",
    "*.optim.lr_warmup_steps_ratio": "[0,1]",
    "*.optim.weight_decay": ">=0",
    "*.optim.eps": ">0",
    "*.optim.clip_grad": ">=0",
    "*.optim.loss_scale": ">0",
    "*.optim.initial_loss_scale": ">0",
    "*.optim.min_loss_scale": ">0",
    "*.optim.loss_scale_window": ">=1",
    "*.optim.hysteresis": ">=1",
    "*.megatron.tensor_model_parallel_size": ">=1",
    "*.megatron.pipeline_model_parallel_size": ">=1",
    "*.megatron.virtual_pipeline_model_parallel_size": ">=1",
    "*.megatron.expert_model_parallel_size": ">=1",
    "*.megatron.expert_tensor_parallel_size": ">=1",
    "actor_rollout_ref.actor.megatron.seed": "any",
    "*.megatron.recompute_num_layers": ">=1",
    "*.model.lora.rank": ">=0",
    "*.model.lora.alpha": ">0",
    "*.model.lora.dropout": "[0,1)",
    "actor_rollout_ref.rollout.n": ">=1",
    "actor_rollout_ref.rollout.max_staleness": ">=0",
    "actor_rollout_ref.rollout.partial_rollout_window": ">1",
    "actor_rollout_ref.rollout.temperature": ">0",
    "actor_rollout_ref.rollout.top_p": "(0,1]",
    "actor_rollout_ref.rollout.top_k": ">=-1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ">=1",
    "actor_rollout_ref.rollout.data_parallel_size": ">=1",
    "actor_rollout_ref.rollout.expert_parallel_size": ">=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "(0,1]",
    "actor_rollout_ref.rollout.max_num_batched_tokens": ">=1",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": ">=1",
    "actor_rollout_ref.rollout.val_kwargs.temperature": ">=0",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "(0,1]",
    "actor_rollout_ref.rollout.val_kwargs.top_k": ">=-1",
    "actor_rollout_ref.rollout.val_kwargs.n": ">=1",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": ">=1",
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": ">=0",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": ">=1",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": ">=1",
    "actor_rollout_ref.rollout.multi_turn.tool_timeout_s": ">0",
    "actor_rollout_ref.rollout.multi_turn.tool_workers": ">=1",
    "actor_rollout_ref.rollout.multi_turn.max_abandoned_tool_calls": ">=1",
    "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": ">=1",
    "actor_rollout_ref.rollout.multi_turn.tool_reward_weight": "any",
    "actor_rollout_ref.rollout.multi_turn.endpoint.port": "[0,65535]",
    "actor_rollout_ref.rollout.multi_turn.endpoint.max_body_bytes": ">=1",
    "actor_rollout_ref.rollout.multi_turn.endpoint.request_timeout_s": ">0",
    "actor_rollout_ref.rollout.multi_turn.endpoint.max_sessions": ">=1",
    "actor_rollout_ref.rollout.multi_turn.endpoint.episode_timeout_s": ">0",
    "critic.cliprange_value": ">0",
    "algorithm.gamma": "[0,1]",
    "algorithm.lam": "[0,1]",
    "algorithm.kl_ctrl.kl_coef": ">=0",
    "algorithm.kl_ctrl.horizon": ">=1",
    "algorithm.kl_ctrl.target_kl": ">0",
    "algorithm.rollout_correction.rollout_is_threshold": ">0",
    "algorithm.filter_groups.max_num_gen_batches": ">=0",
    "reward_model.overlong_buffer.len": ">=0",
    "reward_model.overlong_buffer.penalty_factor": ">=0",
    "custom_reward_function.timeout_s": ">=0",
    "custom_reward_function.max_error_fraction": "[0,1]",
    "reward_model.micro_batch_size_per_gpu": ">=1",
    "reward_model.max_length": ">=1",
    "reward_model.http.batch_size": ">=1",
    "reward_model.http.concurrency": ">=1",
    "reward_model.http.timeout_s": ">0",
    "reward_model.http.retries": ">=0",
    "reward_model.http.backoff_s": ">=0",
    "reward_model.http.max_response_bytes": ">=1",
    "reward_model.http.max_abandoned_threads": ">=1",
    "trainer.total_epochs": ">=1",
    "trainer.total_training_steps": ">=1",
    "trainer.critic_warmup": ">=0",
    "trainer.sync_check_freq": ">=0",
    "trainer.test_freq": "any",
    "trainer.save_freq": "any",
    "trainer.max_ckpt_to_keep": ">=1",
    "trainer.nnodes": ">=1",
    "trainer.n_gpus_per_node": ">=1",
    "trainer.dist_timeout_minutes": ">0",
    "trainer.console_block_freq": ">=1",
    "trainer.max_nonfinite_steps": ">=0",
}


def range_rule(key: str) -> str | None:
    """The RANGES rule of ``key`` (the first pattern that matches), or None."""
    import fnmatch

    return next((rule for pat, rule in RANGES.items() if fnmatch.fnmatchcase(key, pat)), None)


def _in_range(value: float, rule: str) -> bool:
    if rule == "any":
        return True
    if rule[0] in "[(":
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        above = value >= lo if rule[0] == "[" else value > lo
        below = value <= hi if rule[-1] == "]" else value < hi
        return above and below
    if rule.startswith(">="):
        return value >= float(rule[2:])
    return value > float(rule[1:])  # ">x"


def check_ranges(cfg: Config) -> None:
    """One line for the first numeric key outside its range."""
    for key, ftype in known_keys(Config).items():
        if not (("int" in str(ftype) or "float" in str(ftype)) and "list" not in str(ftype)):
            continue
        value, rule = get_key(cfg, key), range_rule(key)
        if value is None or rule is None or isinstance(value, bool):
            continue
        if isinstance(value, str) and "str" in str(ftype):  # a number-or-text key: checked by its parser
            continue
        if not isinstance(value, (int, float)) or not _in_range(value, rule):
            raise ConfigError(f"{key}={value!r} is out of range: it must be {_describe(rule)}.")
        if not math.isfinite(value):  # nan passes no comparison but "any"; inf passes ">0"
            raise ConfigError(f"{key}={value!r} is not a finite number: set it to one ({_describe(rule)}).")


def _describe(rule: str) -> str:
    if rule == "any":
        return "any finite value"
    if rule[0] in "[(":
        return f"in {rule}"
    return f">= {rule[2:]}" if rule.startswith(">=") else f"> {rule[1:]}"


def get_key(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
