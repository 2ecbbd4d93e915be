"""Config: YAML + overrides, did-you-mean for unknown keys, and every validation error path."""

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.config import ConfigError, load_config, validate

DIMS = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}


def cfg_with(*overrides):
    return load_config(None, ["actor_rollout_ref.model.path=/models/x", *overrides])


def test_defaults_are_production_values():
    cfg = cfg_with()
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.algorithm.adv_estimator == "gae"
    # derived defaults have a single source of truth
    assert cfg.critic.model.path == "/models/x"
    assert cfg.data.tokenizer == "/models/x"
    assert cfg.critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.2
    assert cfg.trainer.default_local_dir == "checkpoints/megatron_rl/ppo"


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "data:\n  train_batch_size: 64\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: 3.0e-6\n"
    )
    cfg = load_config(str(f), ["actor_rollout_ref.actor.optim.lr=1e-5", "trainer.logger=[console,jsonl]"])
    assert cfg.data.train_batch_size == 64
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.trainer.logger == ["console", "jsonl"]


def test_unknown_key_suggests():
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref\.actor\.optim\.lrr.*Did you mean 'actor_rollout_ref\.actor\.optim\.lr'",
    ):
        cfg_with("actor_rollout_ref.actor.optim.lrr=1")


def test_unknown_key_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  save_frequency: 3\n")
    with pytest.raises(ConfigError, match=r"trainer\.save_frequency.*Did you mean 'trainer\.save_freq'"):
        load_config(str(f))


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"data\.train_batch_size"):
        cfg_with("data.train_batch_size=abc")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["data.train_batch_size"])


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (
            ["data.train_batch_size=10"],
            4,
            r"data\.train_batch_size x actor_rollout_ref\.rollout\.n = 10 x 1 = 10 samples must be a "
            r"multiple of the data-parallel size 4",
        ),
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=6", "data.train_batch_size=12"],
            4,
            r"ppo_mini_batch_size x actor_rollout_ref\.rollout\.n = 6 x 1",
        ),
        (
            ["data.train_batch_size=24", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
            4,
            r"not a multiple of",
        ),
        (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"], 4, r"not divisible by"),
        (
            ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"],
            4,
            r"tensor_model_parallel_size=4 must divide",
        ),
        (
            ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"],
            3,
            r"must divide the model's 28 layers",
        ),
        (
            [
                "critic.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            ],
            4,
            r"critic\.megatron.*set them equal",
        ),
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
            4,
            r"rollout\.tensor_model_parallel_size=3",
        ),
        (
            ["actor_rollout_ref.rollout.data_parallel_size=3"],
            4,
            r"tensor_model_parallel_size=1 x data_parallel_size=3: the 3 ranks one engine spans",
        ),
        (
            [
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                "actor_rollout_ref.rollout.expert_parallel_size=4",
            ],
            4,
            r"rollout\.expert_parallel_size=4 does not divide the engine's 2 ranks",
        ),
        (["algorithm.adv_estimator=grpo"], 4, r"rollout\.n >= 2"),
        (["algorithm.adv_estimator=ppo2"], 4, r"algorithm\.adv_estimator='ppo2' is not one of"),
        (["data.truncation=sideways"], 4, r"data\.truncation"),
        (["actor_rollout_ref.actor.clip_ratio_c=0.5"], 4, r"clip_ratio_c"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"], 4, r"ppo_micro_batch_size_per_gpu"),
        (["trainer.resume_mode=resume_path"], 4, r"resume_from_path"),
        (["trainer.logger=[console,mlflow]"], 4, r"trainer\.logger"),
    ],
)
def test_validation_errors(overrides, world, match):
    cfg = cfg_with(*overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=world, model_dims=DIMS)


def test_valid_config_passes():
    validate(cfg_with(), world_size=4, model_dims=DIMS)


def test_model_dims_read_from_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2})
    )
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={tmp_path}",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        ],
    )
    with pytest.raises(ConfigError, match=r"key/value heads \(2\)"):
        validate(cfg, world_size=4)


def test_every_field_documented():
    import dataclasses

    from megatron_rl.config import Config, field_docs

    def walk(cls: type) -> None:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(value):
                walk(type(value))
            else:
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"

    walk(Config)


def test_verl_command_line_forms():
    """Scalars where a list is expected, and Hydra's +key=value, as verl's scripts write them."""
    cfg = cfg_with("data.train_files=/data/train.parquet", "trainer.logger=console", "+trainer.save_freq=5")
    assert cfg.data.train_files == ["/data/train.parquet"] and cfg.trainer.logger == ["console"]
    assert cfg.trainer.save_freq == 5
    with pytest.raises(ConfigError, match=r"Unknown config key 'trainer.save_frequency'.*trainer\.save_freq"):
        cfg_with("+trainer.save_frequency=5")


def test_micro_batch_error_names_the_users_value():
    cfg = cfg_with("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7")  # 256 x 1 / 4 = 64 per rank
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=4, model_dims=DIMS)
    assert "ppo_micro_batch_size_per_gpu=7 must be positive and divide the 64 sequences" in str(e.value)


def test_help_and_key_listing():
    run = [sys.executable, "-m", "megatron_rl.config"]
    help_out = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True).stdout
    assert help_out.startswith("usage: python -m megatron_rl.config")
    keys = subprocess.run([*run, "--keys"], capture_output=True, text=True, check=True).stdout
    assert "[actor_rollout_ref.actor.optim]" in keys
    assert "  actor_rollout_ref.actor.optim.lr: float = 1e-06\n      Peak learning rate." in keys
    assert "trainer.save_freq" in keys
    only = subprocess.run([*run, "--keys", "critic.optim"], capture_output=True, text=True, check=True).stdout
    assert "critic.optim.lr" in only and "actor_rollout_ref" not in only


def test_print_config_command():
    """The printer is a dry run: the resolved config on stdout, then every problem on stderr (exit 1)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl.config",
            "actor_rollout_ref.model.path=/m",
            "data.train_batch_size=8",
        ],
        capture_output=True,
        text=True,
    )
    assert "train_batch_size: 8" in out.stdout and "path: /m" in out.stdout
    assert out.returncode == 1 and "actor_rollout_ref.model.path=/m: no such directory" in out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "megatron_rl.config", "data.nope=1"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "Unknown config key 'data.nope'" in bad.stderr
    # The training entry point's form (--config FILE) is accepted too, with the file's values; the
    # two-node config checks at its own launch size (only its model path is missing here).
    from megatron_rl.config import main

    yaml_out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.config", "--config", "yaml/gsm8k_qwen2.5_7b.yaml"]
        + ["--nnodes", "2", "--nproc", "8", "--no-device"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert "tensor_model_parallel_size: 4" in yaml_out.stdout and "optimizer_offload: true" in yaml_out.stdout
    problems = [line for line in yaml_out.stderr.splitlines() if line.startswith("megatron-rl error:")]
    assert problems and all("Qwen2.5-7B-Instruct" in p or "data/gsm8k" in p for p in problems), problems
    with pytest.raises(SystemExit, match="--config needs a YAML file"):
        main(["--config"])


def test_import_is_cheap_and_silent():
    code = (
        "import sys, megatron_rl; print(megatron_rl.__version__); "
        "assert 'megatron.core' not in sys.modules and 'transformers' not in sys.modules"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == "" and p.stdout.strip()


@pytest.mark.parametrize(
    "name,world,dims",
    [
        ("cpu_demo", 2, (4, 2, 2)),
        ("gsm8k_qwen2.5_0.5b", 8, (14, 2, 24)),  # heads, kv heads, layers of the real model
        ("gsm8k_qwen2.5_1.5b", 8, (12, 2, 28)),
        ("gsm8k_qwen2.5_7b", 16, (28, 4, 28)),
    ],
)
def test_shipped_configs_validate(name, world, dims):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "yaml", f"{name}.yaml"))
    heads, kv, layers = dims
    validate(
        cfg,
        world_size=world,
        model_dims={"num_attention_heads": heads, "num_key_value_heads": kv, "num_layers": layers},
    )
    if name.startswith("gsm8k"):
        assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
        assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2 and cfg.algorithm.adv_estimator == "gae"


def _numeric_keys():
    from megatron_rl.config import Config, known_keys

    return [
        k
        for k, t in known_keys(Config).items()
        if ("int" in str(t) or "float" in str(t)) and "list" not in str(t)
    ]


def test_every_numeric_key_has_a_range():
    from megatron_rl.config import range_rule

    missing = [k for k in _numeric_keys() if range_rule(k) is None]
    assert not missing, f"keys without a RANGES rule: {missing}"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n=0"),
        ("actor_rollout_ref.rollout.n=-1", "actor_rollout_ref.rollout.n=-1"),
        ("actor_rollout_ref.actor.ppo_epochs=0", "actor_rollout_ref.actor.ppo_epochs=0"),
        ("critic.ppo_epochs=0", "critic.ppo_epochs=0"),
        ("trainer.total_training_steps=0", "trainer.total_training_steps=0"),
        ("trainer.total_training_steps=-3", "trainer.total_training_steps=-3"),
        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0", "tensor_model_parallel_size=0"),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0", "ppo_micro_batch_size_per_gpu=0"),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0",
            "rollout.log_prob_micro_batch_size_per_gpu=0",
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-2",
            "ref.log_prob_micro_batch_size_per_gpu=-2",
        ),
        ("actor_rollout_ref.rollout.top_p=0", "top_p=0"),
        ("algorithm.gamma=1.5", "algorithm.gamma=1.5"),
        ("actor_rollout_ref.actor.optim.lr=-1e-6", "actor_rollout_ref.actor.optim.lr=-1e-06"),
        ("trainer.max_ckpt_to_keep=0", "trainer.max_ckpt_to_keep=0"),
        ("custom_reward_function.timeout_s=-1", "custom_reward_function.timeout_s=-1"),
    ],
)
def test_out_of_range_values_fail_naming_the_key(override, key):
    cfg = cfg_with("trainer.device=cpu", override)
    with pytest.raises(ConfigError, match="out of range") as excinfo:
        validate(cfg, world_size=1, model_dims=DIMS)
    msg = str(excinfo.value)
    assert key in msg and "\n" not in msg


def test_a_value_given_for_a_section_is_one_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data: 5\n")
    with pytest.raises(
        ConfigError, match=r"'data' \(from .*c\.yaml\) is a section of keys, not a value: got 5"
    ):
        load_config(str(f))
    with pytest.raises(ConfigError, match=r"'trainer' \(from command line\) is a section"):
        load_config(None, ["trainer=3"])


def test_rollout_correction_and_dapo_keys_are_checked():
    with pytest.raises(ConfigError, match="rollout_rs_threshold is not"):
        validate(cfg_with("algorithm.rollout_correction.rollout_rs=seq_sum_k1"), 1, DIMS)
    with pytest.raises(ConfigError, match="unknown option 'seq_k1'"):
        validate(
            cfg_with(
                "algorithm.rollout_correction.rollout_rs=seq_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ),
            1,
            DIMS,
        )
    with pytest.raises(ConfigError, match=r"policy_loss\.loss_mode='ppo2' is not one of"):
        validate(cfg_with("actor_rollout_ref.actor.policy_loss.loss_mode=ppo2"), 1, DIMS)
    with pytest.raises(ConfigError, match=r"overlong_buffer: len=600"):
        validate(
            cfg_with("reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=600"),
            1,
            DIMS,
        )
    cfg = cfg_with("custom_reward_function.reward_kwargs.method=flexible")
    assert cfg.custom_reward_function.reward_kwargs == {"method": "flexible"}
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == cfg.data.max_response_length
    assert cfg.critic.loss_scale_factor == cfg.data.max_response_length
