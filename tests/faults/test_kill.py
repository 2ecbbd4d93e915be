"""kill -9 at a real job (2 CPU ranks of the demo job, one checkpoint per step, most of the job's time
spent saving): no published checkpoint is ever partial, nothing the job started is left, and the same
command resumes bit for bit; under ``launch/torchrun.sh --max-restarts 1`` the job recovers by itself.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import ROOT
from tests.faults import jobs

EVERY_STEP = {"trainer.save_freq": 1, "trainer.max_ckpt_to_keep": 2}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_at_a_random_moment_loses_no_checkpoint(demo, straight, tmp_path, seed):
    """The whole job (torchrun's group; the ranks follow it) killed at a random moment of its first
    steps, counted from the moment it has logged step 1 (however long it took to start)."""
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(
        jobs.torchrun_cmd(demo, run_dir, 12, **EVERY_STEP), cwd=ROOT, env=jobs.env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        jobs.wait_for_step(proc, run_dir, 1)
        sids = jobs.sessions(jobs.rank_pids(proc.pid))
        time.sleep(random.Random(seed).uniform(0.0, 6.0))  # where in the next steps: a save, mostly
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert jobs.left_behind(sids) == []
    jobs.assert_consistent(run_dir)
    jobs.assert_resumes_exactly(demo, run_dir, straight, more=2)


SLOW = pytest.mark.slow


VICTIMS = [
    "torchrun",
    pytest.param("rank0", marks=SLOW),
    pytest.param("rank1", marks=SLOW),
    pytest.param("launcher", marks=SLOW),
]


@pytest.mark.parametrize("victim", VICTIMS)
def test_kill_9_after_saves_leaves_no_process(demo, straight, tmp_path, victim):
    """kill -9 of torchrun, of one rank, or of launch/torchrun.sh alone, once the run has saved: every
    process of the job (torchrun, the ranks and whatever they started, the launcher's log pipe) is gone,
    and the checkpoints are consistent (resumed exactly, so the run directory's lock was released:
    slow cases). A killed launcher stops the job as a SIGTERM would: the ranks save the step they are
    in and exit."""
    run_dir = str(tmp_path / "run")
    proc = jobs.launch(demo, tmp_path, run_dir, 40, "kill9", **EVERY_STEP)
    try:
        jobs.wait_for_step(proc, run_dir, 2)
        torchrun, ranks = jobs.job(proc.pid)
        sids = jobs.sessions([torchrun, *ranks])
        helpers = [p for p in jobs.children().get(proc.pid, []) if p != torchrun]  # tee, output filter
        victim_pid = {"torchrun": torchrun, "rank0": ranks[0], "rank1": ranks[1], "launcher": proc.pid}
        os.kill(victim_pid[victim], signal.SIGKILL)
        assert proc.wait(timeout=300) != 0
        # the launcher's death reaches the ranks through torchrun, which waits for them to save
        assert jobs.left_behind(sids, timeout=300 if victim == "launcher" else 20) == [], (
            "a process outlived its rank"
        )
    finally:
        jobs.kill_launch(proc)
    deadline = time.monotonic() + 60  # they end at their pipe's end-of-file, once torchrun is gone
    while [p for p in helpers if jobs.alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [jobs.cmdline(p)[:120] for p in helpers if jobs.alive(p)] == []
    last = jobs.assert_consistent(run_dir)
    assert last >= 2
    if victim == "launcher":
        out = (tmp_path / "kill9.out").read_text()
        assert f"megatron-rl: received SIGTERM at step {last}; saved" in out, out[-4000:]
    if victim != "torchrun":
        jobs.assert_resumes_exactly(demo, run_dir, straight)


@pytest.mark.slow
def test_a_rank_killed_under_max_restarts_finishes_from_the_checkpoint(demo, straight, tmp_path):
    """launch/torchrun.sh --max-restarts 1: rank 1 killed mid-run, the launcher starts torchrun again,
    the ranks resume from the newest checkpoint and the job ends at its last step (exit 0), every row
    equal to a run never interrupted."""
    run_dir = str(tmp_path / "run")
    proc = jobs.launch(demo, tmp_path, run_dir, 6, "restart", ("--max-restarts", "1"), **EVERY_STEP)
    try:
        jobs.wait_for_step(proc, run_dir, 2)
        torchrun, ranks = jobs.job(proc.pid)
        sids = jobs.sessions(ranks)
        os.kill(ranks[1], signal.SIGKILL)
        rc = proc.wait(timeout=600)
    finally:
        jobs.kill_launch(proc)
    out = (tmp_path / "restart.out").read_text()
    assert rc == 0, out[-4000:]
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", out)
    assert len(resumed) == 1 and int(resumed[0][1]) >= 2, out[-4000:]
    assert jobs.left_behind(sids) == []
    got = jobs.rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight, got, strict=False):
        assert jobs.stable(a) == jobs.stable(b), f"step {a['step']} differs"


HANG = os.path.join(os.path.dirname(__file__), "workers", "hang_in_step.py")


@pytest.mark.slow
def test_a_hung_rank_times_out_and_the_job_restarts_from_the_checkpoint(demo, straight, tmp_path):
    """Rank 1 hangs in step 3's update (tests/faults/workers/hang_in_step.py): rank 0's collective times
    out after trainer.dist_timeout_minutes (30 s here), the job fails, launch/torchrun.sh --max-restarts 1
    starts it again, the ranks resume from the newest checkpoint and the job ends at its last step (exit
    0), every row equal to a run never interrupted, nothing left behind."""
    run_dir, mark = str(tmp_path / "run"), tmp_path / "hung"
    environ = {"ENTRY": HANG, "FAULT_RANK": "1", "FAULT_STEP": "3", "FAULT_MARK": str(mark)}
    kw = {**EVERY_STEP, "trainer.dist_timeout_minutes": 0.5}
    proc = jobs.launch(demo, tmp_path, run_dir, 6, "hang", ("--max-restarts", "1"), environ, **kw)
    try:
        jobs.wait_for_step(proc, run_dir, 2)
        sids = jobs.sessions(jobs.job(proc.pid)[1])
        rc = proc.wait(timeout=600)
    finally:
        jobs.kill_launch(proc)
    out = (tmp_path / "hang.out").read_text()
    assert rc == 0, out[-4000:]
    assert mark.exists(), "rank 1 never hung"
    assert "trainer.dist_timeout_minutes" in out, out[-4000:]  # the failure names the key
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", out)
    assert len(resumed) == 1 and int(resumed[0][1]) == 2, out[-4000:]
    assert jobs.left_behind(sids) == []
    got = jobs.rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight, got, strict=False):
        assert jobs.stable(a) == jobs.stable(b), f"step {a['step']} differs"
