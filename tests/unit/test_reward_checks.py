"""Reward and rollout-correction settings that cannot work fail before any model is built, in one line
naming the key: threshold order, reward-model path and architecture, URL schemes, placement wording."""

import json

import pytest

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.errors import LaunchError

DIMS = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_layers": 2}


def cfg_with(*overrides):
    return load_config(None, ["actor_rollout_ref.model.path=/models/x", *overrides])


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def _model_dir(tmp_path, name: str, archs: list[str]) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": archs, "model_type": "llama"}))
    return str(d)


def test_rollout_rs_threshold_lower_above_upper():
    cfg = cfg_with(
        "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
        "algorithm.rollout_correction.rollout_rs_threshold='2_0.5'",  # quoted: YAML reads 2_0.5 as 20.5
    )
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1, model_dims=DIMS)
    text = _one_line(e.value)
    assert "algorithm.rollout_correction.rollout_rs_threshold='2_0.5'" in text and "lower <= upper" in text


def test_reward_model_path_missing(tmp_path):
    cfg = cfg_with("reward_model.enable=true", f"reward_model.model.path={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match=r"reward_model\.model\.path=.*nowhere: no such directory") as e:
        validate(cfg, world_size=1, model_dims=DIMS)
    _one_line(e.value)


def test_a_causal_lm_is_not_a_reward_model(tmp_path):
    lm = _model_dir(tmp_path, "lm", ["LlamaForCausalLM"])
    cfg = cfg_with("reward_model.enable=true", f"reward_model.model.path={lm}")
    with pytest.raises(
        ConfigError, match=r"reward_model\.model\.path=.* is a causal LM \(LlamaForCausalLM\)"
    ) as e:
        validate(cfg, world_size=1, model_dims=DIMS)
    _one_line(e.value)
    # the control: a sequence classifier passes
    rm = _model_dir(tmp_path, "rm", ["LlamaForSequenceClassification"])
    validate(
        cfg_with("reward_model.enable=true", f"reward_model.model.path={rm}"), world_size=1, model_dims=DIMS
    )


@pytest.mark.parametrize(
    "key,url",
    [
        ("reward_model.http.url", "ftp://host/score"),
        ("reward_model.http.url", "localhost:8000"),
        ("reward_model.http.proxy", "socks5://proxy:1080"),
    ],
)
def test_reward_urls_are_http(key, url):
    overrides = [f"{key}={url}"]
    if key.endswith("proxy"):
        overrides.append("reward_model.http.url=http://host:8000/score")
    with pytest.raises(ConfigError) as e:
        validate(cfg_with(*overrides), world_size=1, model_dims=DIMS)
    assert f"{key}='{url}' is not an http:// or https:// URL" in _one_line(e.value)


@pytest.mark.parametrize(
    "key", ["reward_model.http.max_response_bytes", "reward_model.http.max_abandoned_threads"]
)
def test_http_bounds_are_positive(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg_with("reward_model.http.url=http://h:1/s", f"{key}=0"), world_size=1, model_dims=DIMS)


def test_placement_messages_count_actor_ranks_not_the_world():
    from megatron_rl.run.preflight import _check_layout

    # one actor rank (rollout on ranks 1 and 2) under TP=2
    cfg = cfg_with(
        "trainer.placement.rollout=[1, 2]",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.max_staleness=1",
    )
    with pytest.raises(LaunchError) as e:
        _check_layout(cfg, 3, {"LOCAL_WORLD_SIZE": "3"})
    text = _one_line(e.value)
    assert text.startswith("the 1 actor rank of trainer.placement.actor (world size 3)"), text
    assert "world size 3 (" not in text
