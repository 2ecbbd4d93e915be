"""Partial rollouts in the PPO loop (torchrun, two gloo ranks as two data-parallel replicas, each
hosting its own episodes): the tool demo's episodes carry across steps within the staleness bound, and a
run resumed from a checkpoint taken with episodes in flight equals the uninterrupted run, step for step
(multi_turn.schedule=lockstep: which groups end first does not depend on timing)."""

import os

import torch

from megatron_rl.run.checkpoint import SHARED_FILE
from tests.distributed.test_multi_turn import demo, run_demo  # noqa: F401 (the fixture)
from tests.distributed.test_trainer import metrics, stable

PARTIAL = {
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.partial_rollout": "true",
    "actor_rollout_ref.rollout.max_staleness": 1,
    "actor_rollout_ref.rollout.multi_turn.schedule": "lockstep",
    "trainer.test_freq": -1,
    "trainer.save_freq": 2,
    "trainer.resume_mode": "auto",
}


def same(row: dict) -> dict:
    """What must be equal across runs: no times (the episodes' seconds and the engine's busy share too)."""
    timed = ("multi_turn/episode_s", "multi_turn/engine_busy")
    return {k: v for k, v in stable(row).items() if not k.startswith(timed)}


def test_partial_rollouts_resume_with_episodes_in_flight(demo, tmp_path, torchrun):  # noqa: F811
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_demo(demo, straight, torchrun, **PARTIAL, **{"trainer.total_training_steps": 4})
    run_demo(demo, split, torchrun, **PARTIAL, **{"trainer.total_training_steps": 2})
    run_demo(demo, split, torchrun, **PARTIAL, **{"trainer.total_training_steps": 4})
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert same(ra) == same(rb), f"step {ra['step']} differs"
    # episodes did carry over (trained one version late), never beyond the bound
    assert max(r["rollout/staleness/max"] for r in a) == 1
    assert sum(r["rollout/staleness/mean"] for r in a[1:]) > 0
    # per token (each by its own version): within the bound, and some tokens were one version late
    assert all(0 <= r["rollout/staleness/token_mean"] <= r["rollout/staleness/max"] for r in a)
    assert sum(r["rollout/staleness/token_mean"] for r in a[1:]) > 0
    # the checkpoint keeps the window: every rank's prompts in flight and drawn, none twice
    shared = torch.load(os.path.join(split, "global_step_2", SHARED_FILE), weights_only=False)
    window = shared["partial_rollouts"]
    assert window["size"] == 10 and len(window["ranks"]) == 2  # 1.25 x 16 prompts / 2 ranks
    held = [i for r in window["ranks"] for i in [*r["slots"].values(), *r["queue"]]]
    # 3 sampler batches of 8 a rank drawn by step 2, 16 trained: 8 a rank left, 2 in slots, 6 queued
    assert [len(r["slots"]) for r in window["ranks"]] == [2, 2] and len(held) == 16 == len(set(held))
