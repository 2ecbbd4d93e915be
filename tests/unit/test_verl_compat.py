"""verl command lines: every key of verl's Megatron PPO trainer config is implemented, aliased,
accepted-and-ignored (with a notice) or refused in one line; verl's GSM8K quickstart validates."""

import os

import pytest

from megatron_rl.config import Config, ConfigError, known_keys, load_config, validate
from megatron_rl.verl_compat import compat_table, hydra_config_args, rule_for, verl_key_list
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
            "actor_rollout_ref.model.lora_rank=8",  # verl's older LoRA keys
            "critic.model.lora_alpha=16",
        ],
        notices,
    )
    assert cfg.actor_rollout_ref.model.lora.rank == 8 and cfg.critic.model.lora.alpha == 16
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
        ("actor_rollout_ref.model.lora.type=dora", r"adapters are plain LoRA"),
        ("actor_rollout_ref.actor.megatron.use_megatron_fsdp=True", r"megatron-core's FSDP is not offered"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            load_config(None, [bad])
        assert "\n" not in str(e.value)
    # Ignored keys give their own reason, not their section's.
    notices = []
    load_config(
        None,
        [
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
            "actor_rollout_ref.ref.router_replay.mode=R3",
            "actor_rollout_ref.actor.megatron.use_megatron_fsdp=False",
        ],
        notices,
    )
    assert len(notices) == 2, notices
    assert "whenever actor_rollout_ref.actor.router_replay.mode=R3" in notices[0]
    assert "the reference model routes with its own router" in notices[1]
    # Neither verl's nor ours: still a did-you-mean.
    with pytest.raises(ConfigError, match=r"Did you mean 'trainer.save_freq'"):
        load_config(None, ["trainer.save_frequency=3"])


def test_verl_engine_and_config_group_choices():
    notices: list[str] = []
    cfg = load_config(
        os.path.join(ROOT, "yaml", "cpu_demo.yaml"),
        [
            "model_engine=megatron",
            "actor_rollout_ref.actor.model_engine=megatron",
            "actor@actor_rollout_ref.actor=megatron_actor",
            "critic@critic=megatron_critic",
        ],
        notices,
    )
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2  # the file's layout
    assert sum("verl's Megatron trainer defaults" in n for n in notices) == 2
    for bad, match in (
        ("model_engine=dp", r"model_engine='dp' \(from command line\): this trainer runs Megatron only"),
        ("actor@actor_rollout_ref.actor=dp_actor", r"Megatron only.*accepted: megatron_actor"),
        ("optimizer@actor_rollout_ref.actor=x", r"not one of verl's config groups"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad])


def test_hydra_config_path_and_name(tmp_path):
    (tmp_path / "mine.yaml").write_text("data:\n  train_batch_size: 12\n")
    notices: list[str] = []
    argv = hydra_config_args(["--config-path", str(tmp_path), "--config-name=mine", "a.b=1"], notices)
    assert argv == ["--config", str(tmp_path / "mine.yaml"), "a.b=1"] and not notices
    assert load_config(argv[1], []).data.train_batch_size == 12
    # verl's own base config, named from verl's source tree: its defaults are this config's
    argv = hydra_config_args(
        ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", "x=1"], notices
    )
    assert argv == ["x=1"] and "verl's ppo_megatron_trainer.yaml" in notices[0]
    # anything else stays a file to load, and fails as a missing file does
    argv = hydra_config_args(["--config-path=nowhere", "--config-name=mine"], [])
    with pytest.raises(ConfigError, match="Config file not found: nowhere/mine.yaml"):
        load_config(argv[1], [])


def test_hydra_plus_keys_and_ignored_trainer_keys():
    notices: list[str] = []
    cfg = load_config(None, ["+trainer.val_only=True", "trainer.validation_data_dir=/tmp/v"], notices)
    assert cfg.trainer.val_only is True
    assert notices == [
        "trainer.validation_data_dir is accepted and ignored: validation generations are not dumped."
    ]


def test_override_transformer_config_keys():
    prefix = "+actor_rollout_ref.actor.megatron.override_transformer_config."
    notices: list[str] = []
    cfg = load_config(
        None,
        [
            prefix + "recompute_granularity=full",
            prefix + "recompute_modules=[core_attn,mlp]",
            prefix + "moe_aux_loss_coeff=0.01",
            prefix + "moe_router_dtype=fp32",
            prefix + "moe_permute_fusion=True",
            prefix + "apply_rope_fusion=True",
            prefix + "use_flash_attn=True",
            prefix + "sequence_parallel=False",
            "actor_rollout_ref.actor.megatron.use_remove_padding=True",
            "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.ref.megatron.forward_only=True",
        ],
        notices,
    )
    mp = cfg.actor_rollout_ref.actor.megatron
    # kept for megatron-core's TransformerConfig (the MoE keys are read for an MoE model only)
    assert mp.override_transformer_config == {
        "recompute_modules": ["core_attn", "mlp"],
        "moe_aux_loss_coeff": 0.01,
        "moe_router_dtype": "fp32",
    }
    assert mp.recompute_granularity == "full" and mp.sequence_parallel is False
    assert mp.use_remove_padding is True  # verl's Megatron key is this config's own
    why = {n.split(" ")[0].rsplit(".", 1)[-1]: n for n in notices}
    assert set(why) == {
        "moe_permute_fusion",
        "apply_rope_fusion",
        "use_flash_attn",
        "use_remove_padding",
        "forward_only",
    }
    assert "without TE permute fusion" in why["moe_permute_fusion"]
    assert "fused kernels" in why["apply_rope_fusion"] and "SDPA" in why["use_flash_attn"]
    assert "FSDP" in why["use_remove_padding"] and "forward only" in why["forward_only"]
    for bad, match in (
        (prefix + "context_parallel_size=2", "context parallelism is not implemented"),
        (prefix + "pipeline_model_parallel_layout=Et*3|t*3L", "a per-stage layout string"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [bad])


def test_icepop_threshold_form_validates():
    cfg = load_config(
        None,
        QUICKSTART
        + [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
        ],
    )
    validate(cfg, world_size=1, model_dims=QWEN_05B)
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_2.0"
    cfg.algorithm.rollout_correction.rollout_is_threshold = "2.0_0.5"
    with pytest.raises(ConfigError, match=r"rollout_is_threshold='2.0_0.5'.*lower <= upper"):
        validate(cfg, world_size=1, model_dims=QWEN_05B)


def test_uneven_pipeline_stages_are_read_and_checked_against_the_layers():
    """verl's num_layers_in_first/last_pipeline_stage split the 28 layers; a split that leaves the other
    stages an uneven share is one line naming the keys."""
    from megatron_rl.config import validate
    from megatron_rl.config.layout import pipeline_split
    from tests.unit.test_config import DIMS, cfg_with

    prefix = "actor_rollout_ref.actor.megatron."
    pp4 = [prefix + "pipeline_model_parallel_size=4"]
    key = prefix + "override_transformer_config.num_layers_in_"
    validate(cfg_with(*pp4, key + "first_pipeline_stage=4", key + "last_pipeline_stage=6"), 4, DIMS)
    assert pipeline_split(28, 4, 4, 6) == (4, 9, 9, 6) and pipeline_split(28, 4) == (7, 7, 7, 7)
    with pytest.raises(ConfigError) as e:
        validate(cfg_with(*pp4, key + "first_pipeline_stage=5"), 4, DIMS)
    msg = str(e.value)
    assert "\n" not in msg and key + "first_pipeline_stage" in msg and "23" in msg, msg
