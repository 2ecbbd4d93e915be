"""The forward-only models' megatron sections (reference, reward model) and the colocated engines'
layout: keys that cannot apply fail at load, layouts that leave engines without prompts fail in
validate."""

import pytest

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.config.placement import resolve_placement

DIMS = {"num_attention_heads": 8, "num_key_value_heads": 4, "num_layers": 4}


def cfg_with(*overrides, notices=None):
    return load_config(None, ["actor_rollout_ref.model.path=/models/x", *overrides], notices)


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.ref.megatron.overlap_grad_reduce=true",
        "actor_rollout_ref.ref.megatron.grad_offload=true",
        "actor_rollout_ref.ref.megatron.recompute_num_layers=2",
        "reward_model.megatron.optimizer_offload=true",
        "reward_model.megatron.grad_reduce_in_fp32=false",
    ],
)
def test_a_training_key_on_a_forward_only_model_is_an_unknown_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        cfg_with(override)
    msg = str(e.value)
    assert msg.startswith(f"Unknown config key '{key}'"), msg
    assert "applies only to trained models (actor_rollout_ref.actor.megatron / critic.megatron)" in msg


def test_the_trained_models_keep_their_training_keys():
    cfg = cfg_with(
        "critic.megatron.grad_offload=true", "actor_rollout_ref.actor.megatron.overlap_grad_reduce=true"
    )
    assert cfg.critic.megatron.grad_offload is True
    assert cfg.actor_rollout_ref.actor.megatron.overlap_grad_reduce is True
    assert cfg_with(
        "actor_rollout_ref.ref.megatron.param_offload=true"
    ).actor_rollout_ref.ref.megatron.param_offload


def test_verls_values_of_the_keys_ref_no_longer_has_are_dropped_with_a_notice():
    notices: list[str] = []
    cfg = cfg_with(
        "actor_rollout_ref.ref.megatron.grad_offload=False",
        "actor_rollout_ref.ref.megatron.optimizer_offload=False",
        "actor_rollout_ref.ref.megatron.use_distributed_optimizer=True",
        "reward_model.megatron.use_distributed_optimizer=False",
        "+actor_rollout_ref.ref.megatron.override_transformer_config.recompute_method=uniform",
        notices=notices,
    )
    assert cfg.actor_rollout_ref.ref.megatron.override_transformer_config == {}
    for key in (
        "actor_rollout_ref.ref.megatron.grad_offload",
        "actor_rollout_ref.ref.megatron.use_distributed_optimizer",
        "reward_model.megatron.use_distributed_optimizer",
        "actor_rollout_ref.ref.megatron.override_transformer_config.recompute_method",
    ):
        assert any(n.startswith(key) and "forward passes only" in n for n in notices), (key, notices)


def test_colocated_sglang_engines_below_the_actor_tp_are_refused():
    cfg = cfg_with(
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    )
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=4, model_dims=DIMS)
    msg = str(e.value)
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=1" in msg and "ranks [1, 3]" in msg
    assert "actor_rollout_ref.actor.megatron.tensor" in msg and "one of [2, 4]" in msg


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
        ["actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
        ["actor_rollout_ref.rollout.name=hf"],  # a transformers model on each DP leader: none idles
    ],
)
def test_colocated_layouts_that_feed_every_engine_validate(overrides):
    cfg = cfg_with(
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        *overrides,
    )
    validate(cfg, world_size=4, model_dims=DIMS)


def test_idle_engines_are_counted_on_the_first_pipeline_stage():
    pl = resolve_placement(cfg_with(), 8)
    assert pl.idle_colocated_engines(tp=2, pp=1, engine_ranks=1) == [1, 3, 5, 7]
    assert pl.idle_colocated_engines(tp=4, pp=1, engine_ranks=2) == [2, 6]
    assert pl.idle_colocated_engines(tp=2, pp=2, engine_ranks=1) == [1, 3]
    assert pl.idle_colocated_engines(tp=2, pp=1, engine_ranks=2) == []
    assert pl.idle_colocated_engines(tp=2, pp=1, engine_ranks=4) == []
