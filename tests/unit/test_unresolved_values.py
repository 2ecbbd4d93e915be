"""Values that load_config resolves (None: a default from another key) are refused with a one-line
error naming the key when a config skipped loading, and optional numbers stay optional."""

import pytest

from megatron_rl.config import ConfigError, load_config, validate
from megatron_rl.rollout.base import oom_message

DIMS = {"num_attention_heads": 4, "num_key_value_heads": 4, "num_layers": 2, "vocab_size": 128}


def test_validate_names_the_unresolved_parallel_sizes():
    cfg = load_config(None, ["actor_rollout_ref.model.path=unused", "data.train_batch_size=8"])
    arr = cfg.actor_rollout_ref
    for m in (arr.actor.megatron, arr.ref.megatron, cfg.critic.megatron, cfg.reward_model.megatron):
        m.tensor_model_parallel_size = None  # as before load_config fills it in
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.megatron\.tensor/pipeline"):
        validate(cfg, world_size=1, model_dims=DIMS)


def test_oom_message_without_free_memory():
    msg = oom_message("SGLang", 4, 2, 10, 20, 0.8, 1024, free_bytes=None, total_bytes=80 * 2**30)
    assert "4 prompts x n=2 = 8 sequences" in msg and "GiB" not in msg
