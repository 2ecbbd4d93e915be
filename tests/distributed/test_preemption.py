"""Stopping a run: real launches (launch/torchrun.sh -> torchrun -> 2 CPU ranks of the demo job), real
signals, real checkpoints.

* SIGTERM to the launcher: the ranks finish their step, save it, print one line and exit; the launcher
  exits 143. The same command resumes from that checkpoint (slow test, with the one-run lock seen from
  a second launch on the same directory).
* kill -9 of torchrun: no rank outlives it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "launch", "torchrun.sh")
LINE = re.compile(
    r"^megatron-rl: received SIGTERM at step (\d+); saved (\S+); exiting \(resume with the same command\)$"
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, str]:
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("demo")))


def _args(demo, run_dir, steps: int) -> list[str]:
    return [
        "--nproc", "2", "--config", os.path.join(ROOT, "yaml", "cpu_demo.yaml"),
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.resume_mode=auto", "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}", f"data.train_files=[{demo['train']}]",
        f"data.val_files=[{demo['test']}]", f"actor_rollout_ref.model.path={demo['model']}",
        "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    ]  # fmt: skip


def _launch(demo, tmp_path, run_dir, steps: int, name: str) -> subprocess.Popen:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")
    }
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", LOG_DIR=str(tmp_path / f"logs-{name}"))
    out = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        ["bash", SCRIPT, *_args(demo, run_dir, steps)],
        env=env,
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def _steps(run_dir) -> list[int]:
    path = os.path.join(run_dir, "logs", "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip().endswith("}")]


def _wait_for_step(proc: subprocess.Popen, run_dir, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in _steps(run_dir)):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout}s"
        time.sleep(0.2)


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a launch that is still running: torchrun (in its own session, so not reached through the
    launcher) and so its ranks, then the launcher."""
    if proc.poll() is not None:
        return
    for pid in _children().get(proc.pid, []):
        if "torch.distributed.run" in _cmdline(pid):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=60)


def _stop_with_sigterm(demo, tmp_path, run_dir, name: str) -> tuple[int, str, str]:
    """Launch a 40-step run, SIGTERM the launcher after step 2; returns (stopped step, path, output)."""
    proc = _launch(demo, tmp_path, run_dir, 40, name)
    try:
        _wait_for_step(proc, run_dir, 2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        _kill_launch(proc)
    out = (tmp_path / f"{name}.out").read_text()
    assert rc == 143, f"exit {rc}:\n{out[-4000:]}"
    lines = [ln.strip() for ln in out.splitlines() if "megatron-rl: received SIGTERM at step" in ln]
    assert len(lines) == 1, lines  # one line, from rank 0 only
    m = LINE.match(lines[0])
    assert m, lines[0]
    step, path = int(m.group(1)), m.group(2)
    assert path == os.path.join(run_dir, f"global_step_{step}") and os.path.isdir(path)
    assert max(_steps(run_dir)) == step < 40  # it stopped at the step it saved, well before the end
    with open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == step
    assert "megatron-rl: node 0 stopped by SIGTERM (torchrun exit" in out and f"checkpoint {path}" in out
    return step, path, out


def test_sigterm_to_the_launcher_saves_the_step_and_exits_143(demo, tmp_path):
    _stop_with_sigterm(demo, tmp_path, str(tmp_path / "run"), "stop")


@pytest.mark.slow
def test_preempted_run_resumes_with_the_same_command_and_holds_its_directory(demo, tmp_path):
    """While the first run trains, a second launch on its directory fails in one line naming the
    holder; after SIGTERM, the same command (with more steps) resumes from the saved step."""
    run_dir = str(tmp_path / "run")
    first = _launch(demo, tmp_path, run_dir, 100_000, "first")  # runs until killed below
    try:
        _wait_for_step(first, run_dir, 1)
        holder = _rank0_pid(first.pid)
        second = _launch(demo, tmp_path, run_dir, 40, "second")
        assert second.wait(timeout=180) != 0
        out2 = (tmp_path / "second.out").read_text()
        why = [ln for ln in out2.splitlines() if "is in use by another run" in ln]
        assert why and f"{run_dir} is in use by another run (host=" in why[0], out2[-3000:]
        assert f"pid={holder} " in why[0], why[0]
        assert first.poll() is None  # the holder carries on
    finally:  # this run's own SIGTERM is tested below, from a fresh start
        _kill_launch(first)
    run_dir = str(tmp_path / "run2")
    step, path, _ = _stop_with_sigterm(demo, tmp_path, run_dir, "stop")
    again = _launch(demo, tmp_path, run_dir, step + 2, "resume")
    assert again.wait(timeout=300) == 0, (tmp_path / "resume.out").read_text()[-4000:]
    out = (tmp_path / "resume.out").read_text()
    assert f"resumed from {path} at step {step}" in out
    assert _steps(run_dir) == list(range(1, step + 3))


def _rank0_pid(launcher_pid: int) -> int:
    """The pid that holds the lock: rank 0, a child of torchrun, a child of the launcher."""
    kids = _children()
    torchrun = next(p for p in kids.get(launcher_pid, []) if "torch.distributed.run" in _cmdline(p))
    ranks = sorted(kids.get(torchrun, []))
    return next(p for p in ranks if "megatron_rl.train" in _cmdline(p))


def test_kill_9_of_torchrun_leaves_no_rank_alive(demo, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = _launch(demo, tmp_path, run_dir, 40, "kill9")
    try:
        _wait_for_step(proc, run_dir, 1)
        kids = _children()
        torchrun = [p for p in kids.get(proc.pid, []) if "torch.distributed.run" in _cmdline(p)]
        assert len(torchrun) == 1, [_cmdline(p) for p in kids.get(proc.pid, [])]
        ranks = [p for p in kids.get(torchrun[0], []) if "megatron_rl.train" in _cmdline(p)]
        assert len(ranks) == 2, [_cmdline(p) for p in kids.get(torchrun[0], [])]
        os.kill(torchrun[0], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in ranks), "a rank outlived torchrun"
        assert proc.wait(timeout=30) != 0
    finally:
        _kill_launch(proc)
