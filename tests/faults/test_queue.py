"""The rollout queue of a finished off-policy run: with max_staleness=1 the engines (on a rank of their
own) are always a step ahead, so a 3-step run's final checkpoint must hold step 4's generations (drawn
by version 2): resumed to 6 steps, it equals a 6-step run bit for bit."""

from __future__ import annotations

import os

import pytest

from tests.distributed.test_trainer import metrics, overrides
from tests.faults.jobs import stable


@pytest.mark.slow
def test_a_finished_staleness_1_run_resumes_to_more_steps_exactly(demo, tmp_path, torchrun):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    kw = {
        "actor_rollout_ref.rollout.max_staleness": 1,
        "trainer.placement.rollout": "[2]",  # actor and critic on [0, 1] (TP=2), the engine on 2
        "trainer.test_freq": -1,
        "trainer.resume_mode": "auto",
    }
    torchrun("train.py", 3, overrides(demo, straight, **kw, **{"trainer.total_training_steps": 6}))
    torchrun("train.py", 3, overrides(demo, split, **kw, **{"trainer.total_training_steps": 3}))
    assert os.path.isfile(os.path.join(split, "global_step_3", "shared_state.pt"))  # the queue
    torchrun("train.py", 3, overrides(demo, split, **kw, **{"trainer.total_training_steps": 6}))
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"
