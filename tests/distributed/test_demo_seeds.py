"""The CPU demo (``make demo``: yaml/cpu_demo.yaml, TP=2 over two torchrun ranks) learns its task on
more than one sampling seed: validation accuracy >= 0.95 at step 60 for each of two
``actor_rollout_ref.rollout.seed`` values, so the recipe does not depend on a lucky seed.

Only the validation schedule differs from the demo (step 60 only, no checkpoint at the end): the
validation and the weight-sync probe draw from seeds of their own, so the training trajectory is the
demo's, step for step."""

import json
import os

import pytest

from megatron_rl.demo import prepare

VAL_KEY = "val-core/toy/copy_last_digit/reward/mean@1"
SEEDS = (1, 2)  # make demo runs the default, 0


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")))


@pytest.mark.slow  # two 60-step runs: 136 s in all on 2 cores at load 7-8; `make test-slow` (CI runs it)
@pytest.mark.parametrize("seed", SEEDS)
def test_demo_learns_on_this_sampling_seed(demo, tmp_path, torchrun, seed):
    out = str(tmp_path / "run")
    kw = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "actor_rollout_ref.model.path": demo["model"],
        "actor_rollout_ref.rollout.seed": seed,
        "trainer.default_local_dir": out,
        "trainer.logger": "[console,jsonl]",
        "trainer.val_before_train": False,
        "trainer.test_freq": 60,
        "trainer.save_at_end": False,
    }
    torchrun("train.py", 2, ["--config", "yaml/cpu_demo.yaml", *(f"{k}={v}" for k, v in kw.items())])
    with open(os.path.join(out, "logs", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows[-1]["step"] == 60
    assert rows[-1][VAL_KEY] >= 0.95, f"rollout.seed={seed}: validation {rows[-1][VAL_KEY]} at step 60"
