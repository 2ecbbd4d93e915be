"""The PPO layout-equivalence checks of tests/distributed/test_ppo_layouts.py on GPUs (NCCL), and bf16.

Same worker, same oracle (the TP1 run, fp32), same tolerances: the CUDA path differs from the CPU one
in the collectives (NCCL), the device of every buffer and the kernels. The bf16 run trains through the
optimizer's fp32 master weights and must still move log-probs in the direction of the advantages.
Needs 2 GPUs (``make test-gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.test_ppo_layouts import (  # noqa: F401  (collected here, run against the GPU fixture)
    run_all_layouts,
    run_layout,
    save_models,
    test_data_parallel_replicas_are_identical,
    test_forward_passes_match_tp1,
    test_log_probs_match_hf,
    test_policy_loss_moves_log_probs_in_the_direction_of_the_advantage,
    test_tensor_parallel_padding_and_replicas,
    test_tied_embedding_copies_stay_equal_at_pp2,
    test_update_exercises_every_loss_term,
    test_update_metrics_match_tp1,
    test_updated_weights_match_tp1,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_all_layouts(tmp_path_factory.mktemp("ppo_gpu"), ["--device", "cuda"])


def test_bf16_update_trains_through_fp32_masters(tmp_path, runs):
    actor, critic = save_models(tmp_path)
    r = run_layout(tmp_path, "tp2", actor, critic, ["--device", "cuda", "--dtype", "bfloat16"])["result"]
    ref = runs["tp1"]["result"]
    for role in ("actor", "critic"):
        for key, value in r[role].items():
            assert math.isfinite(value), key
    # bf16 forward passes: same losses to a few percent, same schedule
    assert r["actor"]["actor/pg_loss"] == pytest.approx(ref["actor"]["actor/pg_loss"], rel=0.05)
    assert r["critic"]["critic/vf_loss"] == pytest.approx(ref["critic"]["critic/vf_loss"], rel=0.05)
    assert r["actor"]["actor/lr"] == ref["actor"]["actor/lr"]
    d = r["direction"]
    assert d["mean_delta_pos"] > 0 > d["mean_delta_neg"] and d["frac_right_direction"] > 0.8, d
