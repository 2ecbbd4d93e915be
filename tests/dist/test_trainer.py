"""The PPO loop end to end on CPU (torchrun, TP=2 over two gloo ranks), and bit-exact resume."""

import json
import os

import pytest
import torch

from megatron_rl.demo import prepare

VOLATILE = ("timing_s/", "perf/")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")))


def overrides(demo, out_dir, **kw):
    base = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "data.train_batch_size": 16,
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
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_loop_runs_and_logs_verl_metrics(demo, tmp_path, torchrun):
    out = str(tmp_path / "run")
    torchrun("train.py", 2, overrides(demo, out, **{"trainer.total_training_steps": 2}))
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
        "val/test_score/toy/copy_last_digit",
    ):
        assert key in last, key
        assert last[key] == last[key], f"{key} is NaN"
    assert os.path.isfile(os.path.join(out, "global_step_2", "trainer_state.json"))
    assert open(os.path.join(out, "latest_checkpointed_iteration.txt")).read().strip() == "2"


def test_resume_is_bit_exact(demo, tmp_path, torchrun):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    common = {"trainer.test_freq": -1, "trainer.resume_mode": "auto"}
    torchrun("train.py", 2, overrides(demo, straight, **common, **{"trainer.total_training_steps": 6}))
    torchrun("train.py", 2, overrides(demo, split, **common, **{"trainer.total_training_steps": 3}))
    torchrun("train.py", 2, overrides(demo, split, **common, **{"trainer.total_training_steps": 6}))
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"
    for rank in range(2):
        sa = torch.load(os.path.join(straight, "global_step_6", f"rank_{rank:05d}.pt"), weights_only=True)
        sb = torch.load(os.path.join(split, "global_step_6", f"rank_{rank:05d}.pt"), weights_only=True)
        for part in ("actor", "critic"):
            for k, v in sa[part].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, sb[part][k]), f"rank {rank} {part}.{k} differs"
