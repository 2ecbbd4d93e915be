"""The router_replay key: its values, the runs it is refused for (one line naming the key), verl's
spellings, and a dense actor refused where the model is read."""

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.layout import check_router_replay


def _cfg(*overrides: str):
    return load_config(None, ["actor_rollout_ref.model.path=/x", *overrides])


def test_disabled_r2_and_r3_pass():
    check_router_replay(_cfg(), False)
    check_router_replay(_cfg("actor_rollout_ref.actor.router_replay.mode=R3"), False)
    # R2 replays the actor's own routing: multi-turn and a rollout on ranks of its own are fine
    r2 = ["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.rollout.multi_turn.enable=true"]
    check_router_replay(_cfg(*r2), True)


@pytest.mark.parametrize(
    "overrides,separate,match",
    [
        (["actor_rollout_ref.actor.router_replay.mode=r3"], False, r"not one of"),
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R3",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
            ],
            False,
            r"multi_turn\.enable=true: .* use R2",
        ),
        (["actor_rollout_ref.actor.router_replay.mode=R3"], True, r"trainer\.placement\.rollout, or use R2"),
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R2",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                "actor_rollout_ref.actor.megatron.recompute_granularity=full",
            ],
            False,
            r"enable_gradient_checkpointing=false or PP=1",
        ),
    ],
)
def test_refusals_name_the_key(overrides, separate, match):
    with pytest.raises(ConfigError, match=match) as e:
        check_router_replay(_cfg(*overrides), separate)
    assert "\n" not in str(e.value) and "router_replay.mode" in str(e.value)


def test_verl_spellings():
    cfg = _cfg("actor_rollout_ref.actor.megatron.router_replay.mode=R3")
    assert cfg.actor_rollout_ref.actor.router_replay.mode == "R3"
    with pytest.raises(ValueError, match=r"replay_file.*in memory.*not from files"):
        _cfg("actor_rollout_ref.actor.router_replay.replay_file=/tmp/r.pt")


def test_a_dense_actor_is_refused(tmp_path):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.roles.models import build_models
    from tests.conftest import single_ps

    path = str(tmp_path / "dense")
    save_random_hf_model(path, "qwen2")
    cfg = load_config(
        None, [f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.router_replay.mode=R3"]
    )
    with pytest.raises(ConfigError, match=r"router_replay\.mode=R3 .*dense model: set it to disabled"):
        build_models(cfg, single_ps(), load_model_args(path), 1)
