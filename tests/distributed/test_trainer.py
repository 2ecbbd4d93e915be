"""The PPO loop end to end on CPU (torchrun, TP=2 over two gloo ranks), and bit-exact resume."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_rl.demo import prepare

VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")
OUTSIDE = ("step", "testing", "save_checkpoint")  # timing_s/* keys that are not phases of the step


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")))


def overrides(demo, out_dir, **kw):
    base = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "data.train_batch_size": 16,
        "actor_rollout_ref.rollout.n": 4,  # the tests' size, whatever the demo's
        "data.val_batch_size": 32,
        "actor_rollout_ref.model.path": demo["model"],
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
        "critic.ppo_micro_batch_size_per_gpu": 8,
        "trainer.default_local_dir": out_dir,
        "trainer.logger": "[console,jsonl]",
        "trainer.test_freq": 2,
        "trainer.val_before_train": False,
    }
    base.update(kw)
    return ["--config", "yaml/cpu_demo.yaml", *(f"{k}={v}" for k, v in base.items())]


def metrics(out_dir):
    with open(os.path.join(out_dir, "logs", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def stable(row):
    """A metrics row without times and memory (actor/perf/*_gb too): what must be equal across runs."""
    return {k: v for k, v in row.items() if not (k.startswith(VOLATILE) or "/perf/" in k)}


def test_loop_runs_and_logs_verl_metrics(demo, tmp_path, torchrun):
    out = str(tmp_path / "run")
    steps = {"trainer.total_training_steps": 2, "trainer.save_freq": 1, "trainer.max_ckpt_to_keep": 1}
    torchrun("train.py", 2, overrides(demo, out, **steps))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "critic/vf_loss",
        "critic/vf_explained_var",
        "critic/score/mean",
        "critic/rewards/mean",
        "critic/advantages/mean",
        "critic/returns/mean",
        "response_length/mean",
        "response_length/clip_ratio",
        "timing_s/gen",
        "timing_s/reshard",
        "timing_s/old_log_prob",
        "timing_s/values",
        "timing_s/adv",
        "timing_s/update_critic",
        "timing_s/update_actor",
        "timing_s/step",
        "timing_s/save_checkpoint",
        "perf/throughput",
        "perf/max_memory_allocated_gb",
        "perf/padding_fraction",
        "val-core/toy/copy_last_digit/reward/mean@1",
    ):
        assert key in last, key
        assert last[key] == last[key], f"{key} is NaN"
    assert os.path.isfile(os.path.join(out, "global_step_2", "trainer_state.json"))
    # Every second of a step is in a named phase (validation and saving come after the step).
    for r in rows:
        phases = sum(v for k, v in r.items() if k.startswith("timing_s/") and k.split("/")[1] not in OUTSIDE)
        assert phases >= 0.97 * r["timing_s/step"], (r["step"], phases, r["timing_s/step"])
    # save_freq=1 with max_ckpt_to_keep=1: step 1 was published, then pruned; no partial save is left.
    assert sorted(os.listdir(out)) == [
        "checkpoint_order.txt",
        "config.yaml",
        "global_step_2",
        "latest_checkpointed_iteration.txt",
        "logs",
        "run.lock",
        "summary.json",
    ]
    assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    # The run record: the resolved config and a summary naming the final scores and where things are.
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["global_step"] == 2 and summary["checkpoint"] == os.path.join(out, "global_step_2")
    assert "val-core/toy/copy_last_digit/reward/mean@1" in summary["final"]
    from megatron_rl.config import load_config

    record = load_config(os.path.join(out, "config.yaml"))
    assert record.trainer.total_training_steps == 2 and record.data.train_files == [demo["train"]]
    # A fresh run in the same directory (resume_mode=disable) keeps its own record and metrics file.
    torchrun("train.py", 2, overrides(demo, out, **{**steps, "trainer.total_training_steps": 1}))
    assert [r["step"] for r in metrics(out)] == [1]
    with open(os.path.join(out, "logs", "metrics.1.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert os.path.isfile(os.path.join(out, "config.1.yaml")) and os.path.isfile(
        os.path.join(out, "summary.1.json")
    )

    # max_ckpt_to_keep=1 keeps the newest by save order: the second run's step 1, not the first's step 2.
    assert sorted(d for d in os.listdir(out) if d.startswith("global_step_")) == ["global_step_1"]
    # The trained actor exports to an HF directory that transformers loads, with the trained weights.
    hf_dir = str(tmp_path / "hf")
    actor_ckpt = os.path.join(out, "global_step_1", "actor")
    cmd = [sys.executable, "-m", "ckpt_tools", "mcore-to-hf", "--ckpt", actor_ckpt, "--out", hf_dir]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(demo["model"], dtype=torch.float32)
    w = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(trained.state_dict()[w], initial.state_dict()[w])
    # ... with the run's tokenizer (the trainer's checkpoint carries it)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(hf_dir).encode("copy 3 7 1 =") == AutoTokenizer.from_pretrained(
        demo["model"]
    ).encode("copy 3 7 1 =")


def test_token_budget_micro_batches_give_the_fixed_path_numbers(demo, tmp_path, torchrun):
    """use_dynamic_bsz (budget 64 tokens: micro-batches of 3-4 compacted sequences) computes the same
    step as fixed micro-batches of 8 padded ones, with the reference model in the step too."""
    kw = {"trainer.total_training_steps": 1, "actor_rollout_ref.actor.use_kl_loss": True}
    dyn = {
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 64,
    }
    runs = {}
    for name, extra in (("fixed", {}), ("dynamic", dyn)):
        out = str(tmp_path / name)
        torchrun("train.py", 2, overrides(demo, out, **kw, **extra))
        (runs[name],) = metrics(out)
    fixed, dynamic = runs["fixed"], runs["dynamic"]
    for key, want in stable(fixed).items():
        if isinstance(want, float) and key != "training/epoch":
            assert dynamic[key] == pytest.approx(want, rel=1e-4, abs=1e-5), key
    assert dynamic["actor/kl_loss"] > 0 and dynamic["critic/vf_loss"] > 0
    # the fixed path pads every sequence to the batch's longest; the budget groups similar lengths
    assert dynamic["perf/padding_fraction"] < fixed["perf/padding_fraction"]


OFFLOAD_ALL = {
    **{f"actor_rollout_ref.actor.megatron.{k}_offload": True for k in ("param", "grad", "optimizer")},
    **{f"critic.megatron.{k}_offload": True for k in ("param", "grad", "optimizer")},
    "actor_rollout_ref.ref.megatron.param_offload": True,
}


@pytest.mark.slow  # over 45 s: `make test-slow` (CI runs it)
def test_resume_is_bit_exact(demo, tmp_path, torchrun):
    """Six steps in one run (with every *_offload key on: the training state is parked in host memory
    during each rollout) equal 3 + 3 steps resumed from a checkpoint (no offload), bit for bit."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    common = {"trainer.test_freq": -1, "trainer.resume_mode": "auto"}
    six = {"trainer.total_training_steps": 6, **OFFLOAD_ALL, "actor_rollout_ref.actor.use_kl_loss": True}
    torchrun("train.py", 2, overrides(demo, straight, **common, **six))
    kl = {"actor_rollout_ref.actor.use_kl_loss": True}  # a reference model too
    torchrun("train.py", 2, overrides(demo, split, **common, **kl, **{"trainer.total_training_steps": 3}))
    torchrun("train.py", 2, overrides(demo, split, **common, **kl, **{"trainer.total_training_steps": 6}))
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"
    # Final weights: the published torch_dist checkpoints hold identical tensors.
    for part in ("actor", "critic"):
        wa, wb = (
            torch_dist_tensors(os.path.join(straight, "global_step_6", part)),
            torch_dist_tensors(os.path.join(split, "global_step_6", part)),
        )
        assert wa.keys() == wb.keys() and wa
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{part}.{k} differs"
    # Optimizer states (megatron's sharded state: fp32 main weights, Adam's moments) and counters.
    for part in ("actor_optim", "critic_optim"):
        oa, ob = (torch_dist_tensors(os.path.join(d, "global_step_6", part)) for d in (straight, split))
        assert oa.keys() == ob.keys() and any("exp_avg" in k for k in oa), sorted(oa)[:5]
        for k in oa:
            assert torch.equal(oa[k], ob[k]), f"{part}.{k} differs"
    for tp_rank in range(2):
        name = f"mp_rank_{tp_rank:02d}_000.pt"
        oa = torch.load(os.path.join(straight, "global_step_6", name), weights_only=True)
        ob = torch.load(os.path.join(split, "global_step_6", name), weights_only=True)
        for part in ("actor_optim", "critic_optim"):
            assert_same(oa[part], ob[part], f"{name} {part}")


@pytest.mark.slow  # over 45 s: `make test-slow` (CI runs it)
def test_resume_with_more_data_parallel_replicas(demo, tmp_path, torchrun):
    """Saved at TP=2 on 2 processes, resumed at TP=2 x DP=2 on 4: optimizer states are per model shard."""
    out = str(tmp_path / "run")
    common = {"trainer.test_freq": -1, "trainer.resume_mode": "auto"}
    torchrun("train.py", 2, overrides(demo, out, **common, **{"trainer.total_training_steps": 1}))
    torchrun("train.py", 4, overrides(demo, out, **common, **{"trainer.total_training_steps": 2}))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    with open(os.path.join(out, "global_step_2", "trainer_state.json")) as f:
        assert json.load(f)["layout"] == {"tp": 2, "pp": 1, "dp": 2, "world_size": 4}
    # Re-running the finished job says so in one line instead of resuming into nothing.
    again = torchrun("train.py", 2, overrides(demo, out, **common, **{"trainer.total_training_steps": 2}))
    assert "is at step 2, the run's last step (2): nothing to train" in again
    assert [r["step"] for r in metrics(out)] == [1, 2]


def torch_dist_tensors(path):
    """Every tensor of a torch_dist checkpoint, read with torch.distributed.checkpoint (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
    meta = dcp.FileSystemReader(path).read_metadata()
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def assert_same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


REWARD_WITH_ACC = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = float(solution_str.strip().split(" ")[0] == str(ground_truth)) if solution_str.strip() else 0.0
    return {"score": right, "acc": right, "length_chars": float(len(solution_str))}
"""


def test_dapo_filter_mismatch_correction_and_verl_names(demo, tmp_path, torchrun):
    """GRPO with DAPO's group filter and overlong shaping, GSPO's loss, token TIS and sequence MIS on the
    engine's log-probs, a reward function with extra keys: the step runs and logs verl's names."""
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_WITH_ACC)
    out = str(tmp_path / "run")
    kw = {
        "trainer.total_training_steps": 2,
        "algorithm.adv_estimator": "grpo",
        "algorithm.filter_groups.enable": True,
        "algorithm.rollout_correction.rollout_is": "token",
        "algorithm.rollout_correction.rollout_rs": "seq_sum_k1",
        "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0",
        "reward_model.overlong_buffer.enable": True,
        "reward_model.overlong_buffer.len": 1,
        "reward_model.overlong_buffer.penalty_factor": 0.1,
        "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
        "actor_rollout_ref.actor.kl_loss_type": "k3+",
        "actor_rollout_ref.actor.use_kl_loss": True,
        "custom_reward_function.path": str(reward),
    }
    torchrun("train.py", 2, overrides(demo, out, **kw))
    last = metrics(out)[-1]
    for key in (
        "actor/loss",
        "actor/kl_loss",
        "train/num_gen_batches",
        "train/num_dropped_groups",
        "reward/acc/mean",
        "reward/length_chars/mean",
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_rs_seq_masked_fraction",
        "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max",
        "prompt_length/clip_ratio",
        "response/aborted_ratio",
        "timing_per_token_ms/gen",
        "timing_per_token_ms/update_actor",
        # the reward function returns "acc": it is the core validation variable, the rest auxiliary
        "val-core/toy/copy_last_digit/acc/mean@1",
        "val-aux/toy/copy_last_digit/reward/mean@1",
        "val-aux/toy/copy_last_digit/length_chars/mean@1",
    ):
        assert key in last, key
    assert last["train/num_gen_batches"] >= 1
    # The engine (transformers, fp32) and the trainer (megatron, fp32) agree closely on CPU.
    assert last["training/rollout_probs_diff_max"] < 1e-3
    assert abs(last["rollout_corr/kl"]) < 1e-4


def test_group_filter_that_never_fills_the_batch_stops_in_one_line(demo, tmp_path):
    """Every group scores the same (a constant reward): the filter drops them all and the run stops at
    algorithm.filter_groups.max_num_gen_batches with one line naming the key."""
    reward = _constant_reward(tmp_path, 1.0)
    out = str(tmp_path / "run")
    kw = {
        "trainer.total_training_steps": 2,
        "algorithm.adv_estimator": "grpo",
        "algorithm.filter_groups.enable": True,
        "algorithm.filter_groups.max_num_gen_batches": 2,
        "custom_reward_function.path": str(reward),
    }
    proc = _run_train(demo, out, kw)
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "max_num_gen_batches" in ln]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "algorithm.filter_groups" in lines[0] and "2 generation rounds" in lines[0]
    assert "megatron-rl error: config error: " in lines[0]  # the rank's own line, not a traceback


def _constant_reward(tmp_path, value: float):
    """A reward file whose function scores every response ``value``."""
    path = tmp_path / "constant_reward.py"
    signature = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
    path.write_text(f"{signature}\n    return {value!r}\n")
    return path


def _run_train(demo, out, kw, timeout=300):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "megatron_rl.train", *overrides(demo, out, **kw)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=root)


def test_non_finite_updates_are_skipped_then_stop_the_run(demo, tmp_path):
    """A reward of 3e38 makes the critic's squared error overflow (and the advantages with it): every
    update is non-finite. Each is skipped and logged; the second step in a row stops the run in one
    line, before that step's save, naming the last checkpoint (step 1)."""
    reward = _constant_reward(tmp_path, 3e38)
    out = str(tmp_path / "run")
    kw = {
        "trainer.total_training_steps": 4,
        "trainer.save_freq": 1,
        "trainer.max_nonfinite_steps": 2,
        "trainer.test_freq": -1,
        "custom_reward_function.path": str(reward),
    }
    proc = _run_train(demo, out, kw)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    warned = [ln for ln in text.splitlines() if "step 1: optimizer steps skipped for a non-finite" in ln]
    assert warned and "update_critic: 2" in warned[0], text[-3000:]
    lines = [ln for ln in text.splitlines() if "trainer.max_nonfinite_steps=2" in ln]
    assert lines and "megatron-rl error: " in lines[0], text[-3000:]
    assert os.path.join(out, "global_step_1") in lines[0]
    assert not os.path.exists(os.path.join(out, "global_step_2"))
    rows = metrics(out)
    assert rows[0]["critic/nonfinite_grad_steps"] == 2  # both optimizer steps of the update


def test_a_hung_reward_function_ends_the_job_at_its_timeout(demo, tmp_path):
    """A reward function that never returns: the job ends within the reward timeout (plus start-up),
    not the 30-minute collective timeout, with one line naming the function and the sample."""
    import time

    reward = tmp_path / "hang.py"
    reward.write_text(
        "import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    time.sleep(3600)\n"
    )
    kw = {
        "trainer.total_training_steps": 2,
        "trainer.test_freq": -1,
        "custom_reward_function.path": str(reward),
        "custom_reward_function.timeout_s": 2,
    }
    t0 = time.monotonic()
    proc = _run_train(demo, str(tmp_path / "run"), kw, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - t0 < 120, text[-3000:]
    lines = [ln for ln in text.splitlines() if "did not return within 2 s" in ln]
    assert lines and "compute_score" in lines[0] and "data_source='toy/copy_last_digit'" in lines[0], text[
        -3000:
    ]


def test_resuming_on_other_prompts_of_the_same_size_fails_in_one_line(demo, tmp_path, torchrun):
    out = str(tmp_path / "run")
    first = {"trainer.total_training_steps": 1, "trainer.test_freq": -1, "trainer.resume_mode": "auto"}
    torchrun("train.py", 2, overrides(demo, out, **first))
    other = prepare(str(tmp_path / "other"), seed=1)  # as many rows, other digits
    kw = {**first, "trainer.total_training_steps": 2, "data.train_files": f"[{other['train']}]"}
    proc = _run_train(demo, out, kw)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [ln for ln in text.splitlines() if "megatron-rl error: config error: data.train_files=" in ln]
    assert lines and "hold other prompts than the run that wrote" in lines[0], text[-3000:]
    assert "global_step_1/actor" in lines[0]
