"""Placement on CPU (gloo, the transformers engine): the rollout or the critic on ranks of their own,
one-step-off-policy rollout (and resume with its queued generations), and re-placement by SIGUSR1
through launch/torchrun.sh.

The oracle of a separate role is the colocated loop: with staleness 0 and as many engines as training
DP ranks, both sample the same prompts with the same seeds from the same weights, and a critic on its
own ranks sees the same rows as on the actor's, so every logged number must be equal.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.distributed.test_trainer import metrics, overrides, stable

SEPARATE = {"trainer.placement.rollout": "[2]"}  # actor and critic on [0, 1] (TP=2), the engine on 2


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("demo")))


@pytest.mark.slow  # over 45 s: `make test-slow` (CI runs it)
def test_critic_and_rollout_on_ranks_of_their_own_give_the_colocated_numbers(demo, tmp_path, torchrun):
    """Actor on rank 0, critic on rank 1, the engine on rank 2, against all three on one rank: three
    steps and a validation equal. A checkpoint written by the colocated run resumes in the separate
    placement (the critic's weights, Adam state and LR position go to its rank, the engine gets the
    actor's weights) and step 3 equals again; the separate run's checkpoint has the colocated layout
    (critic/ and critic_optim/ beside the actor's)."""
    kw = {
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
        "trainer.total_training_steps": 3,
        "trainer.save_freq": 2,
        "trainer.test_freq": 3,
    }
    colocated, separate, resumed = (str(tmp_path / d) for d in ("colocated", "separate", "resumed"))
    own = {"trainer.placement.critic": "[1]", "trainer.placement.rollout": "[2]"}
    torchrun("train.py", 1, overrides(demo, colocated, **kw))
    torchrun("train.py", 3, overrides(demo, separate, **kw, **own))
    a, b = metrics(colocated), metrics(separate)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert "critic/vf_loss" in b[-1] and "val-core/toy/copy_last_digit/reward/mean@1" in b[-1]
    for ra, rb in zip(a, b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"
    assert all(r["rollout/staleness/max"] == 0 for r in b)
    assert all(r["perf/critic_busy_s"] > 0 for r in b)  # the critic's own time, beside the actor's wait
    for d in ("critic", "critic_optim"):
        assert os.path.isdir(os.path.join(separate, "global_step_2", d))
    again = {
        "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": os.path.join(colocated, "global_step_2"),
        "trainer.save_freq": -1,
    }
    torchrun("train.py", 3, overrides(demo, resumed, **{**kw, **own, **again}))
    c = metrics(resumed)
    assert [r["step"] for r in c] == [3]
    assert stable(c[0]) == stable(a[2])


@pytest.mark.slow  # over 45 s: `make test-slow` (CI runs it)
def test_a_critic_of_two_dp_ranks_of_its_own_gives_the_colocated_numbers(demo, tmp_path, torchrun):
    """The actor and the engines on ranks [0, 1] (DP 2), the critic on [2, 3] (DP 2), against all on
    [0, 1]: each critic DP rank receives the rows its colocated twin holds (over the bridge group, not
    the job's store), so two steps are equal."""
    kw = {
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": -1,
    }
    colocated, separate = str(tmp_path / "colocated"), str(tmp_path / "separate")
    torchrun("train.py", 2, overrides(demo, colocated, **kw))
    torchrun("train.py", 4, overrides(demo, separate, **kw, **{"trainer.placement.critic": "[2,3]"}))
    a, b = metrics(colocated), metrics(separate)
    assert [r["step"] for r in b] == [1, 2] and "critic/vf_loss" in b[-1]
    assert all(r["perf/critic_busy_s"] > 0 for r in b)  # measured on the critic's own ranks
    for ra, rb in zip(a, b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"


@pytest.mark.slow  # over 45 s: `make test-slow` (CI runs it)
def test_one_step_off_policy_rollout_learns_and_resumes_with_its_queue(demo, tmp_path, torchrun):
    """max_staleness=1: step k+1 is generated while step k trains, and the policy still learns. The
    checkpoint of step 30 holds the generations already asked for (step 31's, sampled by version 29,
    which no checkpoint holds, and step 32's): resumed from it, steps 31-40 equal the straight run's,
    bit for bit."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    kw = {
        "data.train_batch_size": 64,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32,
        "critic.ppo_micro_batch_size_per_gpu": 32,
        "data.val_batch_size": 256,
        "trainer.total_training_steps": 40,
        "trainer.test_freq": 20,
        "actor_rollout_ref.rollout.max_staleness": 1,
        # the demo's recipe (8 samples per prompt, entropy bonus 0.03, lr 2e-3): one-step-stale
        # rollouts reach validation >= 0.9 by step 40
        "actor_rollout_ref.rollout.n": 8,
        "actor_rollout_ref.rollout.seed": 1,
        **SEPARATE,
    }
    torchrun("train.py", 3, overrides(demo, straight, **kw, **{"trainer.save_freq": 30}))
    rows = metrics(straight)
    # step 1 samples with the initial weights (version 0), step k >= 2 with version k - 2
    assert [r["rollout/staleness/max"] for r in rows] == [0.0] + [1.0] * 39
    assert rows[-1]["val-core/toy/copy_last_digit/reward/mean@1"] >= 0.9
    # the behaviour policy's log-probs are kept (the mismatch metrics show the off-policy gap)
    assert "training/rollout_probs_diff_mean" in rows[-1]
    assert rows[-1]["perf/rollout_engine_busy_s"] > 0  # the engines' own time, against the step's

    ckpt = os.path.join(straight, "global_step_30")
    assert os.path.isfile(os.path.join(ckpt, "shared_state.pt"))
    again = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": ckpt, "trainer.save_freq": -1}
    torchrun("train.py", 3, overrides(demo, resumed, **kw, **again))
    b = metrics(resumed)
    assert [r["step"] for r in b] == list(range(31, 41))
    for ra, rb in zip(rows[30:], b, strict=True):
        assert stable(ra) == stable(rb), f"step {ra['step']} differs"


def _write_placement(path, actor: list[int], rollout: list[int]) -> None:
    with open(path, "w") as f:
        f.write(f"actor: {actor}\nrollout: {rollout}\n")


@pytest.mark.slow  # over 45 s: `make test-slow` (CI runs it)
def test_sigusr1_moves_ranks_between_roles_and_training_goes_on(demo, tmp_path):
    """Launcher -> torchrun -> 3 ranks. After step 2 the placement file swaps the roles of ranks 0 and 2
    and the launcher gets SIGUSR1: the ranks save, torchrun starts again, training goes on from the
    saved step in the new placement and ends at its last step."""
    run_dir, layout = str(tmp_path / "run"), str(tmp_path / "placement.yaml")
    _write_placement(layout, [0, 1], [2])
    args = overrides(
        demo,
        run_dir,
        **{
            "trainer.total_training_steps": 10,
            "trainer.test_freq": -1,
            "trainer.resume_mode": "auto",
            "trainer.placement.file": layout,
        },
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")
    }
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", LOG_DIR=str(tmp_path / "logs"))
    out_path = tmp_path / "launch.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            ["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--nproc", "3", *args],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 240
            while (
                not os.path.isfile(os.path.join(run_dir, "logs", "metrics.jsonl"))
                or len(metrics(run_dir)) < 2
            ):
                assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()[-3000:]
                time.sleep(0.2)
            _write_placement(layout, [1, 2], [0])
            proc.send_signal(signal.SIGUSR1)
            rc = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = out_path.read_text()
    assert rc == 0, text[-4000:]
    saved = re.findall(
        r"megatron-rl: received SIGUSR1 at step (\d+); saved (\S+); exiting \(launch/torchrun", text
    )
    assert len(saved) == 1, text[-4000:]
    step = int(saved[0][0])
    assert 2 <= step < 10
    assert f"re-placing: starting torchrun again (resumes from {saved[0][1]})" in text
    assert f"resumed from {saved[0][1]} at step {step}" in text
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11))  # no step lost or repeated
