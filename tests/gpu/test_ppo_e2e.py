"""Three real PPO steps on one GPU with the SGLang engine (tiny model): metrics finite, weights moved.

Runs bench/ppo_step.py (the trainer, unchanged, under torchrun) and reads what it wrote.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


def test_three_ppo_steps_with_sglang(tmp_path):
    out = str(tmp_path / "bench")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "ppo_step.py"), "--model", "tiny", "--nproc", "1"]
    cmd += ["--steps", "3", "--batch", "16", "--micro", "8", "--prompt-len", "32", "--response-len", "32"]
    cmd += ["--no-compare", "--save", "--out", out]
    cmd += ["--set", "actor_rollout_ref.rollout.calculate_log_probs=true"]
    subprocess.run(cmd, check=True, timeout=900)
    with open(os.path.join(out, "colocated", "logs", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/score/mean",
            "timing_s/gen",
            # the engine's log-probs against the trainer's (bf16 on both sides: close, not equal)
            "training/rollout_probs_diff_mean",
            "rollout_corr/k3_kl",
        ):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
        assert r["training/rollout_probs_diff_max"] < 0.5 and abs(r["rollout_corr/kl"]) < 0.1
    assert rows[-1]["actor/grad_norm"] > 0

    # The trained actor differs from the initial HF weights (torch_dist holds global tensors, the
    # layers stacked along a leading dimension).
    from safetensors.torch import load_file

    from tests.distributed.test_trainer import torch_dist_tensors

    trained = torch_dist_tensors(os.path.join(out, "colocated", "global_step_3", "actor"))
    initial = load_file(os.path.join(out, "inputs", "model", "model.safetensors"))
    w0 = initial["model.layers.0.mlp.down_proj.weight"].float()
    w3 = trained["decoder.layers.mlp.linear_fc2.weight"][0].float()
    assert w0.shape == w3.shape and not torch.equal(w0, w3)
