"""The dry run (``python -m megatron_rl.config``): every check the trainer runs before it builds a model,
every problem at once, one line each; and the checks it shares with the trainer's pre-flight (logger
packages, the rollout engine on CPU) that stop a launch before any model exists."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.load import ConfigErrors, find_config
from megatron_rl.run.preflight import check_logger_packages, dry_run, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "yaml", "cpu_demo.yaml")
DEMO_MOE = os.path.join(ROOT, "yaml", "cpu_demo_moe.yaml")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, str]:
    """The CPU demo's model and data, and its tiny reward model (``python -m megatron_rl.demo
    --reward-model``)."""
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("demo")), reward_model=True)


def demo_overrides(demo: dict[str, str]) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={demo['model']}",
        f"data.train_files={demo['train']}",
        f"data.val_files={demo['test']}",
    ]


def problems_of(capsys, argv: list[str]) -> tuple[int, list[str]]:
    rc = main(argv)
    err = capsys.readouterr().err.splitlines()
    return rc, [line for line in err if line.startswith("megatron-rl error: ")]


def test_the_first_hour_command_lists_all_three_problems():
    """A bad estimator, an unknown logger and vLLM on a CPU config: exit 1, one line each, naming what
    the user typed (vllm, not the sglang it is read as)."""
    p = subprocess.run(
        [sys.executable, "-m", "megatron_rl.config", "yaml/cpu_demo.yaml", "algorithm.adv_estimator=grop"]
        + ["trainer.logger=mlflow", "actor_rollout_ref.rollout.name=vllm"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 1
    lines = p.stderr.splitlines()
    errors = [line for line in lines if line.startswith("megatron-rl error: ")]
    assert any("algorithm.adv_estimator='grop'" in e and "Did you mean 'grpo'" in e for e in errors), errors
    assert any("trainer.logger" in e and "'mlflow'" in e for e in errors), errors
    engine = [e for e in errors if "actor_rollout_ref.rollout.name=vllm" in e]
    assert len(engine) == 1 and "actor_rollout_ref.rollout.name=hf" in engine[0]
    # the rewrite is said, not silent; and the resolved config went to stdout
    assert any(line.startswith("megatron-rl: actor_rollout_ref.rollout.name: vLLM") for line in lines)
    assert "adv_estimator: grop" in p.stdout
    assert lines[-1].startswith(f"megatron-rl: dry run: {len(errors)} problem(s)")


def test_a_good_config_passes_and_says_for_which_launch(demo, capsys):
    rc = main([DEMO, *demo_overrides(demo), "--check"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out == ""  # --check: no config printed
    assert captured.err.splitlines()[-1] == "megatron-rl: dry run: OK for 1 node(s) x 2 process(es)"


def test_the_default_launch_counts_expert_parallelism(tmp_path, capsys):
    """Without --nproc the dry run takes the smallest launch of the layout, its expert grid included:
    the shipped MoE demo (TP 1, EP 2) is checked for 2 processes, as its command launches it."""
    from megatron_rl.demo import prepare

    moe = prepare(str(tmp_path), moe=True)
    args = [
        os.path.join(ROOT, "yaml", "cpu_demo_moe.yaml"),
        f"actor_rollout_ref.model.path={moe['model_moe']}",
    ]
    args += [f"data.train_files={moe['train']}", f"data.val_files={moe['test']}", "--check"]
    rc = main(args)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err.splitlines()[-1] == "megatron-rl: dry run: OK for 1 node(s) x 2 process(es)"


def test_world_size_comes_from_nproc_and_nnodes(demo, capsys):
    rc, errors = problems_of(capsys, [DEMO, *demo_overrides(demo), "--check", "--nproc", "3"])
    assert rc == 1 and len(errors) == 1
    assert "world size 3" in errors[0] and "TP=2 x PP=1" in errors[0]
    ok = [DEMO, *demo_overrides(demo), "--check", "--nproc=2", "--nnodes=2", "data.train_batch_size=64"]
    # DP=2: a mini-batch's 16 x 8 sequences are 64 per rank; micro-batches of 32 divide them
    ok += [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "critic.ppo_micro_batch_size_per_gpu=32",
    ]
    assert problems_of(capsys, ok) == (0, [])
    rc, errors = problems_of(capsys, [*ok, "trainer.nnodes=1"])
    assert rc == 1 and errors == [
        "megatron-rl error: trainer.nnodes=1 but this job was launched with 2 (2 node(s) x 2 process(es) per "
        "node): launch it to match, or leave trainer.nnodes unset (the launch decides)."
    ]


def test_every_bad_key_of_a_command_line_at_once(demo, capsys):
    """Unknown keys, a refused verl value and a value of the wrong type: all reported by one load."""
    bad = ["algorithm.adv_estmator=gae", "trainer.save_frequency=3", "data.max_prompt_length=abc"]
    bad += ["actor_rollout_ref.actor.strategy=fsdp"]
    with pytest.raises(ConfigErrors) as e:
        load_config(DEMO, [*demo_overrides(demo), *bad])
    problems = e.value.problems
    assert len(problems) == 4, problems
    for key in ("algorithm.adv_estmator", "trainer.save_frequency", "data.max_prompt_length", "strategy"):
        assert sum(key in p for p in problems) == 1, (key, problems)
    assert any("Did you mean 'algorithm.adv_estimator'?" in p for p in problems)
    rc, errors = problems_of(capsys, [DEMO, *demo_overrides(demo), *bad])
    assert rc == 1 and len(errors) == 4
    # the trainer's one-line explanation prints them all, each as its own line
    from megatron_rl.run.explain import explain

    assert explain(e.value).splitlines() == [f"config error: {p}" for p in problems]


def test_every_bad_value_is_listed_and_a_combination_problem_ends_the_list(demo, capsys):
    values = ["algorithm.kl_ctrl.type=fixd", "actor_rollout_ref.rollout.top_p=1.5", "data.truncation=cut"]
    rc, errors = problems_of(capsys, [DEMO, *demo_overrides(demo), *values, "--check"])
    assert rc == 1 and len(errors) == 3, errors
    for key in ("algorithm.kl_ctrl.type='fixd'", "actor_rollout_ref.rollout.top_p=1.5", "data.truncation"):
        assert sum(key in e for e in errors) == 1, (key, errors)
    # a batch size that does not divide (a combination) is reported once, after the value problems
    rc, errors = problems_of(
        capsys, [DEMO, *demo_overrides(demo), "data.truncation=cut", "data.train_batch_size=63", "--check"]
    )
    assert rc == 1 and len(errors) == 2 and "data.train_batch_size=63" in errors[1], errors


def test_missing_files_are_named(tmp_path, demo, capsys):
    over = [f"data.train_files={tmp_path}/none.parquet", f"actor_rollout_ref.model.path={demo['model']}"]
    rc, errors = problems_of(capsys, [DEMO, *over, "data.val_files=[]", "--check"])
    assert rc == 1 and len(errors) == 1 and f"{tmp_path}/none.parquet" in errors[0]


def test_a_missing_logger_package_is_refused_naming_trainer_logger(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError) as e:
        check_logger_packages(["console", "wandb"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("trainer.logger=['console', 'wandb']")
    assert "pip install wandb" in msg and "trainer.logger=[console]" in msg
    check_logger_packages(["console", "jsonl"])  # nothing to install


def test_the_trainer_refuses_a_missing_logger_before_building_anything(demo, tmp_path, monkeypatch, capsys):
    """On every rank, before a process group or a model: one line, exit 1, no run directory."""
    from megatron_rl import train

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    out = tmp_path / "run"
    argv = ["--config", DEMO, *demo_overrides(demo), "trainer.logger=[console,wandb]"]
    argv += [
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    ]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-rl error: config error: trainer.logger=")
    assert not out.exists()  # nothing was built: no checkpoint directory was claimed
    # torchrun's failure summary shows the same line
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == err[0]


def test_sglang_on_cpu_names_what_was_typed(demo):
    typed: dict = {}
    tp2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"  # an engine per actor TP group
    cfg = load_config(DEMO, [*demo_overrides(demo), "actor_rollout_ref.rollout.name=vllm", tp2], [], typed)
    assert cfg.actor_rollout_ref.rollout.name == "sglang" and typed == {
        "actor_rollout_ref.rollout.name": "vllm"
    }
    (line,) = dry_run(cfg, nproc=2, typed=typed)
    assert line.startswith("actor_rollout_ref.rollout.name=vllm (run as sglang here")
    assert line.endswith("set actor_rollout_ref.rollout.name=hf (the transformers engine).")
    cfg = load_config(
        DEMO,
        [*demo_overrides(demo), "actor_rollout_ref.rollout.name=sglang", tp2],
    )
    (line,) = dry_run(cfg, nproc=2)
    assert line.startswith("actor_rollout_ref.rollout.name=sglang needs a GPU, and trainer.device=cpu")


def test_the_demo_reward_model_is_a_one_score_classifier_the_dry_run_accepts(demo, capsys):
    with open(os.path.join(demo["reward_model"], "config.json")) as f:
        rm = json.load(f)
    assert rm["architectures"] == ["LlamaForSequenceClassification"] and rm.get("num_labels", 1) == 1
    with open(os.path.join(demo["model"], "config.json")) as f:
        assert json.load(f)["vocab_size"] == rm["vocab_size"]
    over = ["reward_model.enable=true", f"reward_model.model.path={demo['reward_model']}"]
    assert problems_of(capsys, [DEMO, *demo_overrides(demo), *over, "--check"]) == (0, [])


def test_home_directory_in_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["data.train_files=~/d/train.parquet", "actor_rollout_ref.model.path=~/m"])
    assert cfg.data.train_files == [f"{tmp_path}/d/train.parquet"]
    assert cfg.actor_rollout_ref.model.path == f"{tmp_path}/m" and cfg.data.tokenizer == f"{tmp_path}/m"


def test_shipped_configs_are_found_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no yaml/ here
    assert find_config("cpu_demo.yaml") == DEMO
    assert find_config("yaml/gsm8k_qwen2.5_7b.yaml") == os.path.join(ROOT, "yaml", "gsm8k_qwen2.5_7b.yaml")
    with pytest.raises(ConfigError, match="the shipped configs are .*cpu_demo.yaml"):
        find_config("nope.yaml")


def test_setup_ships_the_configs_in_the_package():
    text = open(os.path.join(ROOT, "setup.py")).read()
    assert '"megatron_rl.configs": "yaml"' in text and '"megatron_rl.configs": ["*.yaml"]' in text


def test_frozen_models_describe_only_the_keys_they_have():
    from megatron_rl.config import describe_keys

    ref = describe_keys("actor_rollout_ref.ref.megatron")
    assert "actor_rollout_ref.ref.megatron.param_offload" in ref and "optimizer_offload" not in ref
    rm = describe_keys("reward_model.megatron")
    assert "reward_model.megatron.tensor_model_parallel_size" in rm and "use_distributed_optimizer" not in rm
    actor = describe_keys("actor_rollout_ref.actor.megatron.use_distributed_optimizer")
    assert "Shard the fp32 master weights" in actor


def test_keys_of_no_section_say_why_instead_of_printing_nothing(capsys):
    assert main(["--keys", "actor_rollout_ref.ref.megatron.optimizer_offload"]) == 1
    out = capsys.readouterr().out
    assert "applies only to trained models" in out and "actor_rollout_ref.ref runs forward passes only" in out
    assert main(["--keys", "trainer.save_freqq"]) == 1
    assert "Did you mean 'trainer.save_freq'?" in capsys.readouterr().out
    assert main(["--keys", "trainer.save_freq"]) == 0 and "trainer.save_freq: int" in capsys.readouterr().out


def test_known_benign_warnings_are_filtered_by_message_and_module():
    from megatron_rl.train import hide_known_benign_warnings

    grad = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad ..."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hide_known_benign_warnings()
        warnings.warn_explicit(
            grad, UserWarning, "optimizer.py", 66, module="megatron.core.optimizer.optimizer"
        )
        warnings.warn_explicit(
            "Please use DTensor instead and we are deprecating ShardedTensor.",
            FutureWarning,
            "planner_helpers.py",
            489,
            module="torch.distributed.checkpoint.planner_helpers",
        )
        # the same text from anywhere else still shows
        warnings.warn_explicit(grad, UserWarning, "mine.py", 1, module="megatron_rl.ppo")
    assert [str(w.message) for w in seen] == [grad]


def test_plot_says_how_to_get_matplotlib(monkeypatch, tmp_path):
    from megatron_rl.run import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot.plot(str(tmp_path))


def test_half_precision_asked_on_cpu_is_named_in_one_line(demo, capsys):
    """CPU runs train in float32 (summary.json says so): a half-precision dtype key the user set is
    named with what runs instead; the defaults (bf16, for the GPU) and float32 are not."""
    assert main(["--check", DEMO, *demo_overrides(demo)]) == 0
    assert "is for the GPU" not in capsys.readouterr().err
    half = "actor_rollout_ref.actor.megatron.params_dtype=float16"
    assert main(["--check", DEMO, *demo_overrides(demo), half, "trainer.device=cpu"]) == 0
    said = [ln for ln in capsys.readouterr().err.splitlines() if "is for the GPU" in ln]
    assert said == [f"megatron-rl: {half} is for the GPU: on CPU the actor trains in float32."]


def test_a_config_with_several_kinds_of_problem_lists_them_all(demo, capsys):
    """An unknown key, a bad value, every batch-size relation that fails and routing replay on a dense
    model: one dry run lists each in one line (the keys left beside the unknown one are still checked)."""
    argv = [DEMO, *demo_overrides(demo), "--check", "trainer.save_frequency=3", "data.truncation=cut"]
    argv += ["data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]
    argv += ["actor_rollout_ref.rollout.n=4"]  # 3 prompts x 4 samples: the 12 sequences named below
    argv += [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
        "critic.ppo_micro_batch_size_per_gpu=7",
    ]
    argv += ["actor_rollout_ref.actor.router_replay.mode=R3"]
    rc, errors = problems_of(capsys, argv)
    said = [
        "Unknown config key 'trainer.save_frequency'",
        "data.truncation='cut' is not one of",
        "data.train_batch_size=10 is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5 must be positive and divide the 12 sequences",
        "critic.ppo_micro_batch_size_per_gpu=7 must be positive and divide",
        "router_replay.mode=R3 replays expert routing, but",
    ]
    assert rc == 1 and len(errors) == len(said), errors
    for words in said:
        assert sum(words in e for e in errors) == 1, (words, errors)
    # the trainer's check says every batch-size problem at once too
    cfg = load_config(DEMO, [*demo_overrides(demo), *argv[7:11]])
    with pytest.raises(ConfigErrors) as e:
        from megatron_rl.config import validate

        validate(cfg, world_size=2)
    assert len(e.value.problems) == 3, e.value.problems


def test_an_architecture_the_trainer_refuses_is_refused_by_the_dry_run_in_one_line(tmp_path, demo, capsys):
    """gpt-oss (not built): the dry run, ckpt_tools and the model loader all say so in one line."""
    model = tmp_path / "gpt_oss"
    shutil.copytree(demo["model"], model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "architectures": ["GptOssForCausalLM"]}))
    rc, errors = problems_of(capsys, [DEMO, *demo_overrides(demo), f"actor_rollout_ref.model.path={model}"])
    assert rc == 1 and len(errors) == 1 and "GptOssForCausalLM is not supported" in errors[0], errors
    from ckpt_tools.__main__ import main as ckpt_tools

    assert ckpt_tools(["hf-to-mcore", "--hf", str(model), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GptOssForCausalLM is not supported" in err[0], err
    from megatron_rl.errors import ModelRefused
    from megatron_rl.run.explain import explain

    with pytest.raises(ModelRefused) as e:
        from megatron_rl.models.loading import load_model_args_any

        load_model_args_any(str(model))
    assert "\n" not in explain(e.value)  # the trainer's line: no traceback


@pytest.fixture(scope="module")
def moe_demo(tmp_path_factory) -> dict[str, str]:
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("moe")), moe=True)


def test_values_only_the_model_or_a_file_can_refuse_are_one_line_each(moe_demo, tmp_path, capsys):
    """EP against the model's experts, prompt + response against its positions, a port past 65535 and a
    tool config that is not YAML: each refused by the dry run (and so by the trainer's pre-flight) in
    one line naming the key."""
    bad_tools = tmp_path / "tools.yaml"
    bad_tools.write_text("tools: [ {class_name: x\n")
    base = [
        "--check", "--nproc", "3",
        f"actor_rollout_ref.model.path={moe_demo['model_moe']}",
        f"data.train_files={moe_demo['train']}", f"data.val_files={moe_demo['test']}",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
        "data.train_batch_size=48", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
        "critic.ppo_mini_batch_size=12", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "critic.ppo_micro_batch_size_per_gpu=16",
    ]  # fmt: skip
    cases = {
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=3": (
            "expert_model_parallel_size=3 does not divide the 4 experts of",
            "choose one of [1, 2, 4]",
        ),
        "data.max_response_length=60": ("= 16 + 60 = 76 exceeds the 64 positions of", "lower them"),
        "actor_rollout_ref.rollout.multi_turn.endpoint.port=70000": ("port=70000 is out of range", "65535"),
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad_tools}": (
            "tool_config_path=",
            "is not a valid YAML file",
        ),
    }
    for override, wanted in cases.items():
        extra = ["actor_rollout_ref.rollout.multi_turn.enable=true"] if "tool_config" in override else []
        rc, lines = problems_of(capsys, [DEMO_MOE, *base, *extra, override])
        assert rc == 1 and len(lines) == 1, (override, lines)
        assert all(w in lines[0] for w in wanted), (override, lines[0])
    rc, lines = problems_of(capsys, [DEMO_MOE, *base])  # the same launch without them passes
    assert rc == 0 and not lines, lines


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "qwen2_moe"])
def test_every_moe_familys_demo_passes_the_dry_run(arch, tmp_path, capsys):
    """What the trainer checks from a model's config (architecture, experts, positions, sliding window,
    pipeline split) passes for each MoE family's demo model as transformers writes it."""
    from megatron_rl.demo import prepare

    demo = prepare(str(tmp_path / "demo"), moe=True, moe_arch=arch)
    argv = [
        DEMO_MOE, "--check", "--nproc", "2", f"actor_rollout_ref.model.path={demo[f'model_{arch}']}",
        f"data.train_files={demo['train']}", f"data.val_files={demo['test']}",
    ]  # fmt: skip
    rc, lines = problems_of(capsys, argv)
    assert rc == 0 and lines == [], lines
