"""A rollout engine that fails inside a step (tests/faults/workers/engine_fails.py) is restarted in
place: every rank's engine started again, the weights synced again, the step generated again; the run
goes on with exactly the rows of an uninterrupted run. Past actor_rollout_ref.rollout.engine_restarts
the job ends, naming the failure. Any other error in generation (a bug) is not an engine's death: it
ends the job with its own message, without a restart."""

from __future__ import annotations

import os

import pytest

from tests.faults import jobs

WORKER = os.path.join(os.path.dirname(__file__), "workers", "engine_fails.py")
RESTART = "the rollout engine on rank 0 failed (EngineDied: the engine's worker died (injected)); restarting"


def _fails(demo, tmp_path, times: int, steps: int, kind: str = "died"):
    run_dir = str(tmp_path / "run")
    environ = {"FAULT_RANK": "0", "FAULT_STEP": "3", "FAULT_TIMES": str(times), "FAULT_KIND": kind}
    return run_dir, jobs.run_torchrun(demo, run_dir, steps, entry=(WORKER,), environ=environ)


def test_a_failed_engine_restarts_in_place_and_the_run_is_unchanged(demo, straight, tmp_path):
    run_dir, done = _fails(demo, tmp_path, 1, 6)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert out.count(RESTART) == 1, out[-4000:]
    assert "train/3: " + RESTART in out and "(1 of 1: actor_rollout_ref.rollout.engine_restarts)" in out
    got = jobs.rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, 7))
    # counted from the step of the restart on
    assert [r.get("rollout/engine_restarts") for r in got] == [None, None, 1.0, 1.0, 1.0, 1.0]
    for a, b in zip(straight, got, strict=True):
        b = {k: v for k, v in b.items() if k != "rollout/engine_restarts"}
        assert jobs.stable(a) == jobs.stable(b), f"step {a['step']} differs from the uninterrupted run"


@pytest.mark.slow
def test_an_engine_failing_past_its_restarts_ends_the_job_naming_it(demo, straight, tmp_path):
    run_dir, done = _fails(demo, tmp_path, 2, 4)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count(RESTART) == 1, out[-4000:]  # one restart allowed; the second failure ends the job
    assert "EngineDied: the engine's worker died (injected)" in out
    assert jobs.steps_logged(run_dir) == [1, 2]
    assert jobs.assert_consistent(run_dir) == 2
    jobs.assert_resumes_exactly(demo, run_dir, straight)


def test_a_bug_in_generation_ends_the_job_with_its_own_message_and_no_restart(demo, tmp_path):
    run_dir, done = _fails(demo, tmp_path, 1, 4, kind="bug")
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "a shape bug in generation (injected)" in out, out[-4000:]
    assert "restarting" not in out and "EngineDied" not in out, out[-4000:]
    assert jobs.steps_logged(run_dir) == [1, 2]
