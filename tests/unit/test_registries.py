"""One registry per algorithm family: config validation, the trainer and docs/algorithms.md use it."""

from pathlib import Path

import pytest

from megatron_rl.algos import ADV_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES
from megatron_rl.algos.rollout_corr import RS_OPTIONS
from megatron_rl.config import ConfigError, load_config, validate

DOC = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}


@pytest.mark.parametrize(
    "names",
    [
        list(ADV_ESTIMATORS),
        list(POLICY_LOSSES),
        list(LOSS_AGG_MODES),
        [k for k in KL_PENALTIES if not k.endswith("+")],
    ],
)
def test_every_registered_name_is_documented(names):
    missing = [n for n in names if f"`{n}`" not in DOC]
    assert not missing, f"docs/algorithms.md does not name {missing}"


def test_rejection_options_are_documented():
    for family in ("token_k1", "seq_sum_k1", "seq_mean_k1", "seq_max_k2"):
        assert family in RS_OPTIONS
    assert "`token_k1|k2|k3`" in DOC and "`seq_max_k2|k3`" in DOC


@pytest.mark.parametrize(
    ("key", "typo", "suggestion"),
    [
        ("algorithm.adv_estimator", "grp", "grpo"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "gpso", "gspo"),
        ("actor_rollout_ref.actor.loss_agg_mode", "token_mean", "token-mean"),
        ("actor_rollout_ref.actor.kl_loss_type", "low-var-kl", "low_var_kl"),
    ],
)
def test_unknown_names_fail_at_config_time_with_a_suggestion(key, typo, suggestion):
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/x", f"{key}={typo}"])
    with pytest.raises(ConfigError, match=rf"Did you mean '{suggestion}'\?"):
        validate(cfg, world_size=1, model_dims=DIMS)
