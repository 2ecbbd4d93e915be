"""Mixture-of-experts actor -> reshard stream -> transformers engine at EP2, TP2 x EP2 and TP2 x EP2 with
expert TP 1 (torchrun/gloo).

One run per layout (tests/distributed/workers/moe_reshard.py; the layouts of one process count share a
launch) makes every check for Qwen3-MoE (with a dense layer), Mixtral, Qwen2-MoE (a shared expert with
its gate), GLM-4.5 and DeepSeek-V3 (sigmoid routing: the expert-score bias travels in the stream;
DeepSeek-V3's multi-latent attention): engine logits == Megatron
logits at O(1) random weights, the engine's fused experts == the checkpoint's per-expert tensors bit
for bit, one-tensor buckets == default buckets, two swapped experts change the logits, and a dropped
expert bucket fails the integrity check, naming it.
"""

import pytest

from tests.conftest import read_json

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf_moe")
    save_random_hf_model(
        str(root / "qwen3_moe"), "qwen3_moe", seed=5, mlp_only_layers=[1], num_hidden_layers=2
    )
    save_random_hf_model(str(root / "mixtral"), "mixtral", seed=6, num_hidden_layers=2)
    save_random_hf_model(str(root / "qwen2_moe"), "qwen2_moe", seed=7, num_hidden_layers=2)
    save_random_hf_model(str(root / "glm4_moe"), "glm4_moe", seed=8, num_hidden_layers=2)
    # 4 experts in 2 groups (top-2 of the best group), like the others' expert split
    dsv3 = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)
    save_random_hf_model(str(root / "deepseek_v3"), "deepseek_v3", seed=9, num_hidden_layers=2, **dsv3)
    return str(root)


# id: (tp, ep, etp, nproc, the global experts each rank holds, in expert rank order etp-ep-dp)
LAYOUTS = {
    "ep2": (1, 2, 1, 2, [[0, 1], [2, 3]]),
    # each expert split over its two expert-TP ranks
    "tp2ep2": (2, 2, 2, 4, [[0, 1], [0, 1], [2, 3], [2, 3]]),
    # whole experts: EP ranks are TP peers
    "tp2ep2etp1": (2, 2, 1, 4, [[0, 1], [2, 3], [0, 1], [2, 3]]),
}


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory) -> dict[str, list[dict]]:
    """{layout id: every rank's record}: one launch per process count."""
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("moe_reshard")
    launches: dict[int, list[list[str]]] = {}
    for name, (tp, ep, etp, nproc, _) in LAYOUTS.items():
        layout = ["--tp", str(tp), "--ep", str(ep), "--etp", str(etp)]
        out = str(root / f"{name}.json")
        launches.setdefault(nproc, []).append(
            ["--models", hf_models, "--archs", *ARCHS, *layout, "--out", out]
        )
    for nproc, runs in launches.items():
        run_torchrun_runs("moe_reshard", nproc, runs)
    return {name: read_json(str(root / f"{name}.json")) for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_reshard_into_hf_engine(results, layout):
    """``experts``: the global experts each rank holds (expert rank order etp-ep-dp): every rank sends
    its own."""
    tp, ep, etp, nproc, experts = LAYOUTS[layout]
    ranks = results[layout]
    assert len(ranks) == nproc
    leaders = [r for r in ranks if r["leader"]]
    assert len(leaders) == nproc // tp  # one engine per DP replica; EP ranks are DP replicas
    for arch in ARCHS:
        assert [r["archs"][arch]["experts"] for r in ranks] == experts
        for r in leaders:
            a, where = r["archs"][arch], f"{arch} TP{tp} EP{ep} rank {r['rank']}"
            assert a["max_logit"] > 1.0, "weights too small to expose a layout bug"
            assert a["max_diff"] < TOL, f"{where}: engine vs Megatron logits differ by {a['max_diff']:.2e}"
            assert a["names_match_files"] and a["expert_tensors"] > 0, where
            assert a["weights_vs_files"] == 0.0, where
            assert a["small_vs_default"] == 0.0 and a["buckets_small"] > a["expert_tensors"], where
            assert a["swapped_diff"] > 100 * TOL, (
                f"{where}: a stream with experts 0 and 1 swapped went unnoticed"
            )
        routed = list(range(4))  # every arch here has 4 routed experts
        per = len(routed) // nproc
        for r in ranks:  # an SGLang engine over the world at EP = world: rank g holds experts of block g
            got = r["archs"][arch]["engine_ep"]
            assert got["experts"] == routed[r["rank"] * per : (r["rank"] + 1) * per], (arch, r["rank"], got)
            assert got["diff"] == 0.0 and got["tensors"] > 0, (arch, r["rank"], got)
        for r in ranks:
            skip = r["archs"][arch]["skip"]
            msg = skip["message"]
            assert msg is not None and "\n" not in msg, (
                f"rank {r['rank']}: the dropped expert bucket went unnoticed"
            )
            assert ".experts.3." in skip["tensor"], skip
            assert f"does not hold {skip['tensor']} (bucket {skip['bucket']} of {skip['buckets']})" in msg, (
                msg
            )
