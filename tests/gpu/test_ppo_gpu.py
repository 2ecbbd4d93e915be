"""The PPO layout-equivalence checks of tests/distributed/test_ppo_layouts.py on GPUs (NCCL), and bf16.

Same worker, same oracle (the TP1 run, fp32), same tolerances, every architecture: the CUDA path differs
from the CPU one in the collectives (NCCL), the device of every buffer and the kernels; TP2 runs with
sequence parallelism, DP2 with the distributed optimizer. Layouts needing more processes than GPUs are
skipped. The bf16 runs train through the optimizer's fp32 master weights (TP2 + sequence parallelism,
DP2 + distributed optimizer) and must still move log-probs in the direction of the advantages.
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
    test_tied_embedding_copies_stay_equal,
    test_token_budget_plans,
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
    return run_all_layouts(
        tmp_path_factory.mktemp("ppo_gpu"), ["--device", "cuda"], torch.cuda.device_count()
    )


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_bf16_update_trains_through_fp32_masters(tmp_path, runs, layout):
    pairs = save_models(tmp_path)
    bf16 = run_layout(tmp_path, layout, pairs, ["--device", "cuda", "--dtype", "bfloat16"])
    for pair, run in bf16.items():
        r, ref = run["result"], runs["tp1"][pair]["result"]
        for role in ("actor", "critic"):
            for key, value in r[role].items():
                assert math.isfinite(value), (pair, key)
        # bf16 forward passes: same losses to a few percent, same schedule
        assert r["actor"]["actor/pg_loss"] == pytest.approx(ref["actor"]["actor/pg_loss"], rel=0.05), pair
        assert r["critic"]["critic/vf_loss"] == pytest.approx(ref["critic"]["critic/vf_loss"], rel=0.05), pair
        assert r["actor"]["actor/lr"] == ref["actor"]["actor/lr"]
        d = r["direction"]
        assert d["mean_delta_pos"] > 0 > d["mean_delta_neg"] and d["frac_right_direction"] > 0.8, (pair, d)
        for w in run["weights"].values():
            assert w["replica_diff"] == 0.0, f"{pair}: TP copies of a replicated parameter diverged"
