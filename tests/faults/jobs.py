"""Real jobs for the fault tests (launch/torchrun.sh or torchrun -> 2 CPU ranks of the demo job), and
what they leave: metrics rows, checkpoints, processes.

A rank is a session leader (torchrun starts it with a session of its own), so whatever a rank starts
stays in its session after the rank dies: :func:`left_behind` finds every such process in /proc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT
from tests.distributed.test_trainer import VOLATILE

SCRIPT = os.path.join(ROOT, "launch", "torchrun.sh")
TRACKER = "latest_checkpointed_iteration.txt"


def keys(demo, run_dir: str, steps: int, **extra) -> list[str]:
    """The trainer's arguments: the demo at a small batch, one save per ``trainer.save_freq`` (2)."""
    kw = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "actor_rollout_ref.model.path": demo["model"],
        "data.train_batch_size": 16,
        "actor_rollout_ref.rollout.n": 4,  # the tests' size, whatever the demo's
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32,  # a mini-batch's 32 sequences
        "critic.ppo_micro_batch_size_per_gpu": 32,
        "trainer.total_training_steps": steps,
        "trainer.save_freq": 2,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "trainer.resume_mode": "auto",
        "trainer.logger": "[console,jsonl]",
        "trainer.default_local_dir": run_dir,
        **extra,
    }
    return ["--config", os.path.join(ROOT, "yaml", "cpu_demo.yaml"), *(f"{k}={v}" for k, v in kw.items())]


def env(**extra: str) -> dict[str, str]:
    drop = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    out = {k: v for k, v in os.environ.items() if k not in drop}
    return {**out, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **extra}


def launch(
    demo, tmp_path, run_dir: str, steps: int, name: str, opts=(), environ=None, **extra
) -> subprocess.Popen:
    """launch/torchrun.sh --nproc 2 [opts] on the demo (``environ``: more of the launcher's environment,
    e.g. ENTRY); its output goes to tmp_path/<name>.out."""
    out = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        ["bash", SCRIPT, "--nproc", "2", *opts, *keys(demo, run_dir, steps, **extra)],
        env=env(LOG_DIR=str(tmp_path / f"logs-{name}"), **(environ or {})),
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        # SIGINT as a terminal gives it: a runner that started pytest in the background passes it ignored,
        # and bash cannot trap a signal ignored at entry
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


ENTRY = ("-m", "megatron_rl.train")


def torchrun_cmd(demo, run_dir: str, steps: int, entry: tuple[str, ...] = ENTRY, **extra) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *entry]
    return cmd + keys(demo, run_dir, steps, **extra)


def run_torchrun(demo, run_dir: str, steps: int, entry=ENTRY, environ=None, **extra):
    """One plain job of 2 ranks to its end (or its death); returns the finished process. The trainer's
    runs (the straight runs and the resumes the faults are compared with) fork their ranks from the
    test zygote (tests/zygote.py); another entry (a fault-injecting worker, whose deaths torchrun
    handles) runs under real torchrun."""
    if entry == ENTRY and os.environ.get("MEGATRON_RL_TESTS_TORCHRUN") != "1":
        from tests.conftest import zygote

        args = keys(demo, run_dir, steps, **extra)
        codes, out, err = zygote().launch(entry[1], 2, args, env(**(environ or {})), 600, ROOT, module=True)
        rc = next((c for c in codes if c != 0), 0)
        return subprocess.CompletedProcess(["zygote", *entry, *args], rc, out, err)
    return subprocess.run(
        torchrun_cmd(demo, run_dir, steps, entry, **extra), env=env(**(environ or {})), cwd=ROOT,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def stable(row: dict) -> dict:
    """A row without its times and memory figures (which differ from run to run)."""
    return {k: v for k, v in row.items() if not (k.startswith(VOLATILE) or "/perf/" in k)}


def rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "logs", "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def steps_logged(run_dir: str) -> list[int]:
    return [r["step"] for r in rows(run_dir)]


def wait_for_step(proc: subprocess.Popen, run_dir: str, step: int, timeout: float = 300) -> None:
    """Until metrics.jsonl holds ``step`` (the job has started and reached it), however slow the machine."""
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in steps_logged(run_dir)):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout}s"
        time.sleep(0.2)


def tracker(run_dir: str) -> int:
    with open(os.path.join(run_dir, TRACKER)) as f:
        return int(f.read())


def assert_consistent(run_dir: str) -> int:
    """Every published global_step_N is complete, the tracker names one, and the metrics rows are steps
    1..M with M >= the tracker's step, or M one less when that checkpoint holds the missing row (a death
    between publishing it and writing the row: the resume writes it); returns the tracker's step."""
    published = [d for d in os.listdir(run_dir) if d.startswith("global_step_")]
    for d in published:
        assert os.path.isfile(os.path.join(run_dir, d, "trainer_state.json")), d
    last = tracker(run_dir) if os.path.exists(os.path.join(run_dir, TRACKER)) else 0
    assert last == 0 or f"global_step_{last}" in published
    steps = steps_logged(run_dir)
    assert steps == list(range(1, len(steps) + 1)), steps
    if len(steps) < last:
        assert len(steps) == last - 1, (steps, last)
        with open(os.path.join(run_dir, f"global_step_{last}", "trainer_state.json")) as f:
            assert json.load(f)["metrics_row"], f"global_step_{last} holds no metrics row"
    return last


def assert_resumes_exactly(demo, run_dir: str, straight: list[dict], more: int = 1) -> None:
    """The same command with ``more`` steps past the tracker's: it resumes there, and every row equals
    the straight run's (the steps before from the first run, those after from the resumed one)."""
    last = tracker(run_dir)
    done = run_torchrun(demo, run_dir, last + more)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, last + more + 1))
    assert not [d for d in os.listdir(run_dir) if d.endswith(".partial")]
    for a, b in zip(straight, got, strict=False):
        assert stable(a) == stable(b), f"step {a['step']} differs from the straight run"


# ------------------------------------------------------------------------------------------ processes


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children() -> dict[int, list[int]]:
    """ppid -> pids."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))):
            out.setdefault(int(st[1]), []).append(int(d))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _rank(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        return int(env.get(b"RANK", b"-1"))
    except (OSError, ValueError):
        return -1


def _is_rank(cmd: str) -> bool:
    """The trainer, or a worker of tests/faults/workers that runs it."""
    return "megatron_rl.train" in cmd or os.path.join("tests", "faults", "workers") in cmd


def rank_pids(torchrun_pid: int) -> list[int]:
    """The ranks torchrun started, by rank."""
    ranks = [p for p in children().get(torchrun_pid, []) if _is_rank(cmdline(p))]
    return sorted(ranks, key=_rank)


def job(launcher_pid: int) -> tuple[int, list[int]]:
    """(torchrun's pid, the ranks' pids by rank) of a launch, once the ranks exist."""
    kids = children()
    torchrun = [p for p in kids.get(launcher_pid, []) if "torch.distributed.run" in cmdline(p)]
    assert len(torchrun) == 1, [cmdline(p) for p in kids.get(launcher_pid, [])]
    ranks = rank_pids(torchrun[0])
    assert len(ranks) == 2, [cmdline(p) for p in kids.get(torchrun[0], [])]
    return torchrun[0], ranks


def sessions(pids: list[int]) -> set[int]:
    """The session ids of ``pids`` (a rank leads its own)."""
    return {int(st[3]) for p in pids if (st := _stat(p))}


def left_behind(sids: set[int], timeout: float = 20) -> list[str]:
    """Live processes of the sessions ``sids`` still there after ``timeout`` seconds (waiting for the
    kernel to deliver the deaths, not for a clock: it returns as soon as none is left)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            f"{d} {cmdline(int(d))[:120]}"
            for d in os.listdir("/proc")
            if d.isdigit() and (st := _stat(int(d))) and st[0] != "Z" and int(st[3]) in sids
        ]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a launch that is still running: torchrun (its own session) and so its ranks, then the
    launcher."""
    if proc.poll() is not None:
        return
    for pid in children().get(proc.pid, []):
        if "torch.distributed.run" in cmdline(pid):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=60)
