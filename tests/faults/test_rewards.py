"""A reward function that starts failing mid-run (raises, returns NaN, hangs past its timeout), once
the run has saved: the job ends in one line naming the cause (within the reward timeout, not the
collective timeout), nothing is left running, the checkpoints and metrics rows agree, and the newest
checkpoint resumes bit for bit (with the built-in reward, which the function equals until it fails)."""

from __future__ import annotations

import signal

import pytest

from tests.faults import jobs

# The fault is read once per batch, at its first call: a new batch is one scored after another metrics
# row was written (rows are written at the end of each step, before the next step's rollout). A mark
# written while a batch is being scored takes effect from the next batch, so every step is scored either
# wholly before the fault or wholly under it (a batch scored half before, half after would finish with
# errors and differ from the straight run).
REWARD = """
import os, time
from megatron_rl.reward.rules import default_compute_score

_state = {{"rows": -1, "fault": None}}

def _rows():
    try:
        with open({metrics!r}) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    rows = _rows()
    if rows != _state["rows"]:
        _state["rows"] = rows
        _state["fault"] = open({mark!r}).read() if os.path.exists({mark!r}) else None
    fault = _state["fault"]
    if fault is not None:
        if fault == "raise":
            raise ValueError("the scoring service is down")
        if fault == "nan":
            return float("nan")
        time.sleep(3600)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""
WHY = {
    "raise": "the scoring service is down",
    "nan": "reward function returned nan",
    "hang": "did not return within 5 s",
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raise", "nan", "hang"])
def test_a_reward_function_failing_mid_run_ends_the_job_cleanly(demo, straight, tmp_path, fault):
    mark, reward, run_dir = tmp_path / "fault", tmp_path / "reward.py", str(tmp_path / "run")
    metrics = f"{run_dir}/logs/metrics.jsonl"
    reward.write_text(REWARD.format(mark=str(mark), metrics=metrics))
    kw = {
        "trainer.save_freq": 1,
        "custom_reward_function.path": str(reward),
        "custom_reward_function.timeout_s": 5,
    }
    proc = jobs.launch(demo, tmp_path, run_dir, 40, "reward", **kw)
    try:
        jobs.wait_for_step(proc, run_dir, 2)
        sids = jobs.sessions(jobs.job(proc.pid)[1])
        mark.write_text(fault)
        rc = proc.wait(timeout=300)
    finally:
        jobs.kill_launch(proc)
    out = (tmp_path / "reward.out").read_text()
    assert rc != 0 and rc != 128 + signal.SIGKILL, out[-4000:]
    # the cause in one line: the rank's own (a known failure) or the launcher's closing line
    heads = ("megatron-rl error: ", "megatron-rl: node 0 failed")
    said = [ln for ln in out.splitlines() if ln.startswith(heads)]
    assert any(WHY[fault] in ln for ln in said), out[-4000:]
    assert jobs.left_behind(sids) == []
    jobs.assert_consistent(run_dir)
    mark.unlink()
    jobs.assert_resumes_exactly(demo, run_dir, straight)
