"""GroupedExperts (one grouped matmul per projection) equals megatron's SequentialMLP on the same
weights: logits and every gradient at TP1/EP1, EP2 and TP2 x EP2 (one launch of 4 gloo ranks), with
O(1) random weights and a negative control (two experts' fc1 swapped); and a torch_dist checkpoint
written by either module loads bit-exactly into the other at another layout. One PPO update through
the optimizer is compared in test_moe_ppo.py (grouped and sequential EP1 runs)."""

import pytest

from tests.conftest import read_json, run_torchrun

TOL = 1e-4  # fp32: the two modules sum each expert's products in a different order


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("grouped")
    model = save_random_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=5, mlp_only_layers=[1])
    out = str(root / "r.json")
    run_torchrun("grouped_experts.py", 4, ["--model", model, "--out", out])
    return read_json(out)


@pytest.mark.parametrize("layout", ["tp1ep1", "ep2", "tp2ep2"])
def test_grouped_experts_equal_sequential(results, layout):
    for rank, r in enumerate(results[layout]):
        assert r["grouped_modules"] == 3  # the MoE layers of the 4-layer model (layer 1 is dense)
        experts_per_rank = 4 // (2 if layout != "tp1ep1" else 1)
        assert r["sequential_expert_params"] == 3 * 2 * experts_per_rank
        assert r["grouped_expert_params"] == 3 * 2  # two stacked weights per MoE layer
        assert r["weight_diff"] == 0.0
        assert r["max_logit"] > 1.0, "weights too small to expose a layout bug"
        assert r["logit_diff"] < TOL, f"rank {rank}: logits differ by {r['logit_diff']:.2e}"
        assert r["grad_diff"] < TOL * r["max_grad"], f"rank {rank}: {r['grad_worst']} {r['grad_diff']:.2e}"
        assert r["swapped_logit_diff"] > 100 * TOL, "swapping two experts went unnoticed"


def test_torch_dist_checkpoints_cross_between_modules(results):
    for name, r in results["checkpoints"].items():
        assert r["names"] > 0 and r["equal"], name
