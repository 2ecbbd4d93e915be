"""Stop and re-placement signals at a real launch (launch/torchrun.sh -> torchrun -> 2 CPU ranks of the
demo job), after the run has saved (one checkpoint per step): the step the signal finds is saved and
published, nothing the run started is left, and the checkpoint resumes bit for bit.

torchrun delivers a signal to each rank's whole process group (its session), so anything a rank starts
gets it too; these tests look for every process of the ranks' sessions after the job ends.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.conftest import run_forked_ranks
from tests.faults import jobs

SAVED = re.compile(r"^megatron-rl: received (SIG\w+) at step (\d+); saved (\S+); exiting \((.*)\)$", re.M)
EVERY_STEP = {"trainer.save_freq": 1}


def _stop(demo, tmp_path, run_dir: str, sig: signal.Signals, target: str, name: str = "stop"):
    """A 40-step run, signalled once step 2 is logged (two saves done); returns (exit status, output,
    the ranks' sessions)."""
    proc = jobs.launch(demo, tmp_path, run_dir, 40, name, **EVERY_STEP)
    try:
        jobs.wait_for_step(proc, run_dir, 2)
        torchrun, ranks = jobs.job(proc.pid)
        sids = jobs.sessions(ranks)
        os.kill(proc.pid if target == "launcher" else torchrun, sig)
        rc = proc.wait(timeout=300)
    finally:
        jobs.kill_launch(proc)
    return rc, (tmp_path / f"{name}.out").read_text(), sids


@pytest.mark.parametrize(
    "sig,target",
    [
        (signal.SIGTERM, "launcher"),
        pytest.param(signal.SIGUSR2, "launcher", marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, "launcher", marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, "torchrun", marks=pytest.mark.slow),
    ],
    ids=["TERM-launcher", "USR2-launcher", "INT-launcher", "TERM-torchrun"],
)
def test_a_stop_after_saves_publishes_its_step_and_leaves_no_process(demo, straight, tmp_path, sig, target):
    run_dir = str(tmp_path / "run")
    rc, out, sids = _stop(demo, tmp_path, run_dir, sig, target)
    saved = SAVED.findall(out)
    assert len(saved) == 1, out[-4000:]  # one line, from rank 0 only
    name, step, path, _ = saved[0]
    step = int(step)
    assert name == sig.name and 2 <= step < 40
    assert path == os.path.join(run_dir, f"global_step_{step}") and jobs.tracker(run_dir) == step
    assert jobs.assert_consistent(run_dir) == step == max(jobs.steps_logged(run_dir))
    if target == "launcher":
        assert rc == 128 + sig, f"exit {rc}:\n{out[-4000:]}"
        assert f"megatron-rl: node 0 stopped by {sig.name} (torchrun exit" in out
        assert f"checkpoint {path}" in out
    assert "SignalException" not in out  # torchrun's own traceback for the signal it forwarded
    assert jobs.left_behind(sids) == []
    jobs.assert_resumes_exactly(demo, run_dir, straight)


def test_sigusr1_after_saves_restarts_quietly_and_says_where_ranks_are(demo, straight, tmp_path):
    """Re-placement: the ranks save the step, torchrun starts again, one line gives the new placement,
    torchrun's traceback for the signal is not shown, and the run ends with every row equal to a run
    never interrupted."""
    run_dir = str(tmp_path / "run")
    proc = jobs.launch(demo, tmp_path, run_dir, 5, "replace", **EVERY_STEP)
    try:
        jobs.wait_for_step(proc, run_dir, 2)
        sids = jobs.sessions(jobs.job(proc.pid)[1])
        proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=400)
    finally:
        jobs.kill_launch(proc)
    out = (tmp_path / "replace.out").read_text()
    assert rc == 0, out[-4000:]
    saved = SAVED.findall(out)
    assert len(saved) == 1 and saved[0][0] == "SIGUSR1", out[-4000:]
    assert f"re-placing: starting torchrun again (resumes from {saved[0][2]})" in out
    placed = [ln for ln in out.splitlines() if ln.startswith("megatron-rl: placement after the restart: ")]
    assert placed == ["megatron-rl: placement after the restart: actor [0, 1], critic [0, 1], rollout [0, 1]"]
    assert "Traceback" not in out and "SignalException" not in out, out[-4000:]
    assert jobs.steps_logged(run_dir) == [1, 2, 3, 4, 5]
    assert jobs.left_behind(sids) == []
    for a, b in zip(straight, jobs.rows(run_dir), strict=False):
        assert jobs.stable(a) == jobs.stable(b), f"step {a['step']} differs"


@pytest.mark.slow
def test_a_stop_during_a_replacement_stops_the_job(demo, tmp_path):
    """SIGUSR1 then SIGTERM to the launcher: the job stops (exit 143) instead of restarting."""
    run_dir = str(tmp_path / "run")
    proc = jobs.launch(demo, tmp_path, run_dir, 40, "both", **EVERY_STEP)
    try:
        jobs.wait_for_step(proc, run_dir, 1)
        proc.send_signal(signal.SIGUSR1)
        while "received SIGUSR1; forwarded to torchrun" not in (tmp_path / "both.out").read_text():
            assert proc.poll() is None, (tmp_path / "both.out").read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        jobs.kill_launch(proc)
    out = (tmp_path / "both.out").read_text()
    assert rc == 143, out[-4000:]
    assert "re-placing: starting torchrun again" not in out, out[-4000:]
    assert "received SIGTERM during a re-placement: stopping instead of restarting" in out
    assert jobs.assert_consistent(run_dir) >= 1


def _precedence_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_rl.run.lifecycle import PreemptionWatch

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with PreemptionWatch() as watch:
        os.kill(os.getpid(), signal.SIGINT if rank == 0 else signal.SIGUSR1)
        agreed = watch.requested()
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{agreed} {watch.signal_name} {watch.exit_code}")
    dist.destroy_process_group()


def test_a_stop_on_one_rank_outranks_a_replacement_on_another(tmp_path):
    """SIGINT on rank 0 and SIGUSR1 on rank 1 (10 > 2): both ranks agree to stop for SIGINT, exit 130."""
    run_forked_ranks(_precedence_worker, tmp_path)
    for r in (0, 1):
        assert (tmp_path / f"rank{r}").read_text() == "True SIGINT 130"


@pytest.mark.slow
def test_a_second_run_on_the_directory_is_refused_and_the_first_carries_on(demo, tmp_path):
    """While a run trains, a second launch on its directory fails in one line naming the holder (rank 0's
    host and pid); the holder goes on."""
    run_dir = str(tmp_path / "run")
    first = jobs.launch(demo, tmp_path, run_dir, 100_000, "first")  # runs until killed below
    try:
        jobs.wait_for_step(first, run_dir, 1)
        holder = jobs.job(first.pid)[1][0]
        second = jobs.launch(demo, tmp_path, run_dir, 40, "second")
        assert second.wait(timeout=300) != 0
        out2 = (tmp_path / "second.out").read_text()
        why = [ln for ln in out2.splitlines() if "is in use by another run" in ln]
        assert why and f"{run_dir} is in use by another run (host=" in why[0], out2[-3000:]
        assert f"pid={holder} " in why[0], why[0]
        assert first.poll() is None
    finally:
        jobs.kill_launch(first)
