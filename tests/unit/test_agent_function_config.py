"""actor_rollout_ref.rollout.multi_turn.agent_function and .endpoint: validation refuses, in one line
naming the key, a harness file that is missing or lacks the function, an engine that answers on more
than one rank, keys of the built-in loop beside it, a non-loopback host and bounds that are not
positive; the rollout role then runs episodes with the harness instead of the agent loop."""

import pytest

from megatron_rl.config import ConfigError, load_config, validate

DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}
KEY = "actor_rollout_ref.rollout.multi_turn.agent_function"


@pytest.fixture
def harness(tmp_path):
    f = tmp_path / "agent.py"
    f.write_text("import json\n\n\ndef agent_fn(item, base_url):\n    return 1.0\n\n\nother = agent_fn\n")
    return str(f)


def cfg_with(*overrides):
    return load_config(
        None,
        [
            "actor_rollout_ref.model.path=/models/x",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            *overrides,
        ],
    )


def check(*overrides, world: int = 2):
    validate(cfg_with(*overrides), world_size=world, model_dims=DIMS)


def one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_a_valid_harness_passes_and_sets_the_keys(harness):
    check(f"{KEY}.path={harness}")
    check(
        f"{KEY}.path={harness}",
        f"{KEY}.name=other",
        "actor_rollout_ref.rollout.multi_turn.endpoint.max_sessions=8",
    )
    cfg = cfg_with(f"{KEY}.path={harness}", "actor_rollout_ref.rollout.multi_turn.endpoint.max_sessions=3")
    assert cfg.actor_rollout_ref.rollout.multi_turn.endpoint.max_sessions == 3


def test_missing_file_and_missing_function_are_refused(harness, tmp_path):
    with pytest.raises(ConfigError, match=rf"{KEY}\.path=.*nope\.py: no such file") as err:
        check(f"{KEY}.path={tmp_path / 'nope.py'}")
    one_line(err)
    with pytest.raises(ConfigError, match=rf"{KEY}\.name='run'.*defines no top-level function") as err:
        check(f"{KEY}.path={harness}", f"{KEY}.name=run")
    one_line(err)
    broken = tmp_path / "broken.py"
    broken.write_text("def agent_fn(item, base_url)\n")
    with pytest.raises(ConfigError, match=rf"{KEY}\.path=.*cannot be parsed as Python"):
        check(f"{KEY}.path={broken}")


def test_needs_multi_turn_enable(harness):
    with pytest.raises(ConfigError, match=r"multi_turn\.enable=false: set it to true"):
        check(f"{KEY}.path={harness}", "actor_rollout_ref.rollout.multi_turn.enable=false")


@pytest.mark.parametrize(
    "override,world",
    [
        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", 2),
        ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", 2),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", 2),
        ("actor_rollout_ref.rollout.data_parallel_size=2", 2),
    ],
)
def test_engines_of_more_than_one_rank_are_refused(harness, override, world):
    with pytest.raises(ConfigError, match=rf"{KEY}\.path needs an engine that answers on one rank") as err:
        check(f"{KEY}.path={harness}", override, world=world)
    assert "tensor_model_parallel_size = 1" in one_line(err)


def test_rollout_on_ranks_of_its_own_is_refused(harness):
    with pytest.raises(ConfigError, match=r"trainer\.placement\.rollout"):
        check(f"{KEY}.path={harness}", "trainer.placement.actor=[0]", "trainer.placement.rollout=[1]")


def test_a_tool_format_other_than_hermes_is_refused(harness):
    with pytest.raises(ConfigError, match=r"multi_turn\.format='llama3_json' with .*set it to hermes") as e:
        check(f"{KEY}.path={harness}", "actor_rollout_ref.rollout.multi_turn.format=llama3_json")
    one_line(e)


def test_builtin_loop_keys_beside_it_are_refused(harness, tmp_path):
    with pytest.raises(ConfigError, match=rf"multi_turn\.tool_config_path is set together with {KEY}\.path"):
        check(
            f"{KEY}.path={harness}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path}/t.yaml",
        )


@pytest.mark.parametrize(
    "key,value",
    [
        ("max_body_bytes", 0),
        ("request_timeout_s", 0),
        ("max_sessions", 0),
        ("episode_timeout_s", 0),
        ("port", -1),
    ],
)
def test_endpoint_bounds_must_be_positive(harness, key, value):
    with pytest.raises(ConfigError, match=rf"multi_turn\.endpoint\.{key}={value}(\.0)? is out of range"):
        check(f"{KEY}.path={harness}", f"actor_rollout_ref.rollout.multi_turn.endpoint.{key}={value}")


def test_a_host_off_loopback_is_refused(harness):
    with pytest.raises(ConfigError, match=r"endpoint\.host='0\.0\.0\.0' is not a loopback address"):
        check(f"{KEY}.path={harness}", "actor_rollout_ref.rollout.multi_turn.endpoint.host=0.0.0.0")


def test_the_rollout_role_runs_the_harness(harness):
    """make_agent picks the endpoint runner when the path is set, the agent loop otherwise."""

    from megatron_rl.demo import tools_task
    from megatron_rl.roles.rollout import make_agent
    from megatron_rl.rollout.agent.agent_function import AgentFunctionLoop
    from megatron_rl.rollout.agent.agent_loop import AgentLoop
    from tests.conftest import single_ps

    ps = single_ps()
    tok = tools_task.build_tools_tokenizer()
    agent, _ = make_agent(cfg_with(f"{KEY}.path={harness}"), ps, tok)
    assert isinstance(agent, AgentFunctionLoop) and agent.fn(None, "") == 1.0
    agent, _ = make_agent(cfg_with(), ps, tok)
    assert isinstance(agent, AgentLoop)
