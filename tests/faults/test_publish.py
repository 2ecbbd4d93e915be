"""A rank dies at each moment of publishing a checkpoint (tests/faults/workers/die_in_publish.py): the
published checkpoints are complete, the metrics rows agree with them (a row the death kept from being
written is in the checkpoint and written on resume), and the same command resumes bit for bit."""

from __future__ import annotations

import os

import pytest

from tests.faults import jobs

WORKER = os.path.join(os.path.dirname(__file__), "workers", "die_in_publish.py")


@pytest.mark.parametrize(
    "at,tracked",
    [pytest.param("renamed", 1, marks=pytest.mark.slow), pytest.param("tracked", 2, marks=pytest.mark.slow),
     ("published", 2)],
    ids=["renamed", "tracked", "published"],
)  # fmt: skip
def test_a_death_while_publishing_loses_no_row_and_resumes_exactly(demo, straight, tmp_path, at, tracked):
    run_dir = str(tmp_path / "run")
    died = jobs.run_torchrun(
        demo, run_dir, 3, entry=(WORKER,), environ={"FAULT_AT": at, "FAULT_STEP": "2"},
        **{"trainer.save_freq": 1},
    )  # fmt: skip
    assert died.returncode != 0, died.stdout[-2000:]
    assert jobs.steps_logged(run_dir) == [1]  # rank 0 died before writing step 2's row
    assert jobs.assert_consistent(run_dir) == tracked
    jobs.assert_resumes_exactly(demo, run_dir, straight)
