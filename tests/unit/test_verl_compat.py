"""verl command lines: every key of verl's Megatron PPO trainer config is implemented, aliased,
accepted-and-ignored (with a notice) or refused in one line; verl's GSM8K quickstart validates."""

import os

import pytest

from megatron_rl.config import Config, ConfigError, known_keys, load_config, validate
from megatron_rl.verl_compat import compat_table, rule_for, verl_key_list
from tests.conftest import ROOT

# The overrides of verl's GSM8K PPO quickstart command, with this project's model and data paths.
QUICKSTART = [
    "data.train_files=/data/gsm8k/train.parquet",
    "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.model.path=/models/Qwen2.5-0.5B-Instruct",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]
QWEN_05B = {"num_attention_heads": 14, "num_key_value_heads": 2, "num_layers": 24}


def test_every_verl_key_is_classified():
    known = set(known_keys(Config))
    missing = [k for k in list(verl_key_list()) if k not in known and rule_for(k) is None]
    assert not missing, missing


def test_docs_table_is_current():
    with open(os.path.join(ROOT, "docs", "verl_compat.md")) as f:
        assert f.read().rstrip("\n") == compat_table(list(verl_key_list()), set(known_keys(Config))).rstrip(
            "\n"
        ), "regenerate: python -m megatron_rl.verl_docs > docs/verl_compat.md"


def test_verl_quickstart_validates():
    notices: list[str] = []
    cfg = load_config(None, QUICKSTART, notices)
    validate(cfg, world_size=1, model_dims=QWEN_05B)
    assert cfg.actor_rollout_ref.rollout.name == "sglang"
    assert any(n.startswith("actor_rollout_ref.rollout.name: vLLM is not bundled") for n in notices)
    assert cfg.trainer.logger == ["console"] and cfg.data.train_files == ["/data/gsm8k/train.parquet"]


def test_aliases_ignored_keys_and_refusals():
    notices: list[str] = []
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.megatron.dtype=float32",
            "critic.megatron.override_transformer_config.recompute_granularity=selective",
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=256",
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "+data.return_raw_chat=True",
        ],
        notices,
    )
    assert cfg.actor_rollout_ref.actor.megatron.params_dtype == "float32"
    assert cfg.critic.megatron.recompute_granularity == "selective"
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 256
    assert [n.split(" ")[0] for n in notices] == [
        "actor_rollout_ref.rollout.enforce_eager",
        "data.return_raw_chat",
    ]
    for bad, match in (
        (
            "actor_rollout_ref.actor.strategy=fsdp",
            r"strategy='fsdp' \(from command line\): this trainer runs",
        ),
        ("critic.megatron.context_parallel_size=2", r"context parallelism is not implemented \(accepted: 1"),
        ("actor_rollout_ref.model.lora_rank=8", r"LoRA is not implemented"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            load_config(None, [bad])
        assert "\n" not in str(e.value)
    # Neither verl's nor ours: still a did-you-mean.
    with pytest.raises(ConfigError, match=r"Did you mean 'trainer.save_freq'"):
        load_config(None, ["trainer.save_frequency=3"])
