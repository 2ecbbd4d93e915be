"""config.specs: the facts several keys decide, resolved once into frozen per-role specs."""

import dataclasses

import pytest

from megatron_rl.config import ConfigError, CriticConfig, load_config, resolve
from megatron_rl.config.specs import UpdateSpec, keeps_engine_log_probs, reward_kind

BASE = ["actor_rollout_ref.model.path=/models/x", "data.max_response_length=48"]


def specs(*overrides: str, dp_size: int = 1):
    return resolve(load_config(None, [*BASE, *overrides]), "cpu", dp_size)


def test_update_specs_are_one_shape_for_actor_and_critic_with_one_loss_scale():
    cfg = load_config(None, [*BASE, "actor_rollout_ref.actor.clip_ratio_high=0.28"])
    actor = UpdateSpec.of(cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor")
    critic = UpdateSpec.of(cfg.critic, "critic")
    assert (actor.clip_low, actor.clip_high) == (0.2, 0.28)  # clip_ratio_low unset: clip_ratio
    assert critic.clip_low == critic.clip_high == cfg.critic.cliprange_value
    # seq-mean-token-sum-norm's constant: data.max_response_length for both, whatever a batch holds
    assert actor.loss_scale == critic.loss_scale == 48.0
    with pytest.raises(ConfigError, match=r"critic\.loss_scale_factor is unset"):
        UpdateSpec.of(CriticConfig(), "critic")  # a section that skipped load_config


def test_the_facts_each_role_reads():
    s = specs()
    assert s.rollout.dtype == "float32"  # CPU, whatever rollout.dtype says
    assert not s.rollout.keeps_log_probs and not s.actor.keeps_engine_log_probs
    assert s.reward.kind == "rules" and s.reward.by_rule
    kept = specs("algorithm.rollout_correction.rollout_is=token")
    assert kept.rollout.keeps_log_probs and kept.actor.keeps_engine_log_probs  # one fact, both readers
    assert specs("custom_reward_function.path=/x.py").reward.kind == "function"
    assert specs("reward_model.http.url=http://h:1").reward.kind == "http"
    assert specs(
        "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.use_kl_loss=true"
    ).ref.adapters_off
    assert not specs("actor_rollout_ref.model.lora.rank=8").ref.adapters_off  # no KL: no reference at all
    assert specs("actor_rollout_ref.actor.router_replay.mode=R3").rollout.routed_experts
    # 4 prompts over 8 DP ranks: each drawn "prompt" stands for one sample (config.batch_sizes)
    n8 = ["actor_rollout_ref.rollout.n=8", "data.train_batch_size=4"]
    assert specs(*n8, dp_size=8).rollout.samples_per_draw == 1
    assert specs(*n8, dp_size=2).rollout.samples_per_draw == 8


def test_an_unresolved_engine_dtype_is_refused():
    cfg = load_config(None, BASE)
    cfg.actor_rollout_ref.rollout.dtype = None  # what load_config would have filled
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.dtype is unset"):
        resolve(cfg, "cpu")


def test_specs_are_frozen():
    s = specs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.rollout.keeps_log_probs = True  # type: ignore[misc]


def test_the_functions_are_the_specs_home():
    cfg = load_config(None, [*BASE, "actor_rollout_ref.rollout.max_staleness=1"])
    assert keeps_engine_log_probs(cfg) and resolve(cfg, "cpu").rollout.keeps_log_probs
    assert reward_kind(cfg) == resolve(cfg, "cpu").reward.kind
