"""Faults injected into the real CPU demo job: nothing saved is lost, nothing hangs.

Here: kill -9 of the whole job at random moments (most of the job's time is spent saving: one
checkpoint per step), then resume. Elsewhere in the suite, each with its own module:
SIGTERM / SIGUSR2 to the launcher (test_preemption.py, and ``make test-slurm``), a full disk on a real
tmpfs (tests/unit/test_ckpt_guard.py), a reward function that hangs, a non-finite update and a
group filter that never fills its batch (test_trainer.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, str]:
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("demo")))


def _cmd(demo, out: str, steps: int) -> list[str]:
    keys = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "actor_rollout_ref.model.path": demo["model"],
        "data.train_batch_size": 16,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "trainer.total_training_steps": steps,
        "trainer.save_freq": 1,
        "trainer.max_ckpt_to_keep": 2,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.resume_mode": "auto",
        "trainer.logger": "[console,jsonl]",
        "trainer.default_local_dir": out,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return cmd + [
        "-m",
        "megatron_rl.train",
        "--config",
        "yaml/cpu_demo.yaml",
        *(f"{k}={v}" for k, v in keys.items()),
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "trainer_state.json"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_at_a_random_moment_loses_no_checkpoint(demo, tmp_path, seed):
    out = str(tmp_path / "run")
    proc = subprocess.Popen(
        _cmd(demo, out, 12), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    # Start-up takes ~6 s, then ~2.5 s per step of which ~2 s is the save.
    time.sleep(random.Random(seed).uniform(9.0, 20.0))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    # What is on disk: every published global_step_N is complete; the tracker names one of them.
    published = sorted(d for d in os.listdir(out) if d.startswith("global_step_"))
    assert all(_complete(os.path.join(out, d)) for d in published), published
    tracker = os.path.join(out, "latest_checkpointed_iteration.txt")
    last = 0
    if os.path.exists(tracker):
        last = int(open(tracker).read().strip())
        assert f"global_step_{last}" in published

    # The same command (two more steps than it reached) resumes from the tracker's step, bit for bit
    # the step after it, and cleans what the killed save left behind.
    done = subprocess.run(
        _cmd(demo, out, last + 2), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert not [d for d in os.listdir(out) if d.endswith(".partial")]
    with open(os.path.join(out, "logs", "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps[-2:] == [last + 1, last + 2] and steps == sorted(set(steps)), steps
    assert int(open(tracker).read().strip()) == last + 2
