"""Reshard stream -> transformers engine at TP2 (x DP2), PP2 and TP2xPP2 (real torchrun/gloo jobs).

One run per layout (tests/distributed/workers/reshard.py; the layouts of one process count share a
launch) makes every check: engine logits == Megatron logits, engine weights == the original files bit
for bit, tiny buckets == default buckets, a wrong qkv layout is caught, greedy generation ==
transformers' generate, seeded sampling reproduces, engine log-probs == reference log-probs, TP/PP
peers receive identical generations, and a bucket dropped before the engine fails the sync's integrity
check.
"""

import pytest

from tests.conftest import read_json

ARCHS = ["llama", "qwen2", "phi3"]  # untied; tied + qkv bias; fused qkv / gate_up (norms: replicated)
GEN_ARCH = "llama"  # untied head: varied greedy outputs (a tied random model repeats its last token)
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf")
    for i, arch in enumerate(ARCHS):
        save_random_hf_model(str(root / arch), arch, seed=10 + i, tie_word_embeddings=arch == "qwen2")
    return str(root)


LAYOUTS = {"tp2dp2": (2, 1, 4), "pp2": (1, 2, 2), "tp2pp2": (2, 2, 4)}  # id: (tp, pp, nproc)


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory) -> dict[str, list[dict]]:
    """{layout id: every rank's record}: one launch per process count."""
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("reshard")
    args = ["--models", hf_models, "--archs", *ARCHS, "--gen-arch", GEN_ARCH, "--control-arch", GEN_ARCH]
    launches: dict[int, list[list[str]]] = {}
    for name, (tp, pp, nproc) in LAYOUTS.items():
        out = str(root / f"{name}.json")
        launches.setdefault(nproc, []).append([*args, "--tp", str(tp), "--pp", str(pp), "--out", out])
    for nproc, runs in launches.items():
        run_torchrun_runs("reshard", nproc, runs)
    return {name: read_json(str(root / f"{name}.json")) for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reshard_into_hf_engine(results, layout):
    tp, pp, nproc = LAYOUTS[layout]
    ranks = results[layout]
    assert len(ranks) == nproc
    leaders = [r for r in ranks if r["tp_rank"] == 0 and r["pp_rank"] == 0]
    assert len(leaders) == nproc // (tp * pp)

    for r in leaders:
        for arch, a in r["archs"].items():
            where = f"{arch} TP{tp} PP{pp} rank {r['rank']}"
            assert a["max_logit"] > 1.0, "weights too small to expose a layout bug"
            assert a["max_diff"] < TOL, f"{where}: HF engine vs Megatron logits differ by {a['max_diff']:.2e}"
            assert a["weights_vs_files"] == 0.0 and a["weights_checked"] > 20, where
            # Tiny buckets: many more of them, the same bytes, the same weights bit for bit.
            assert a["buckets_small"] >= 20 and a["buckets_small"] > 5 * a["buckets_default"], where
            assert a["bytes_small"] == a["bytes"], where
            assert a["small_vs_default"] == 0.0, where
            assert a["buckets_default"] == pp, "default buckets: one per pipeline stage for a tiny model"
        control = r["archs"][GEN_ARCH]["control_diff"]
        assert control > 100 * TOL, f"a k/v-swapped stream went unnoticed (diff {control:.2e})"

    # a bucket dropped before the engine stops the sync on every rank, naming bucket, tensor and the
    # rank of the (first) engine that missed it
    for r in ranks:
        skip = r["archs"][GEN_ARCH]["skip"]
        msg = skip["message"]
        assert msg is not None and "\n" not in msg, f"rank {r['rank']}: the dropped bucket went unnoticed"
        assert f"does not hold {skip['tensor']} (bucket {skip['bucket']} of {skip['buckets']})" in msg, msg
        assert "the rollout engine on rank 0 " in msg, msg

    for r in leaders:
        g = r["gen"]
        assert g["greedy_deterministic"]
        # Greedy with a stop token == transformers' generate on the original directory.
        assert [per[0][0] for per in g["greedy_stop"]] == g["reference_stop"]
        stopped = 0
        for full, cut in zip(g["greedy"], g["greedy_stop"], strict=True):
            toks, reason = full[0][0], full[0][2]
            assert reason == "length" and len(toks) == 8
            if g["stop"] in toks:
                k = toks.index(g["stop"])
                assert cut[0][0] == toks[: k + 1] and cut[0][2] == "stop"
                stopped += 1
            else:
                assert cut[0][0] == toks and cut[0][2] == "length"
        assert stopped >= 1
        assert g["sample_reproducible"] and g["sample_other_seed_differs"]
        for per in g["sample"]:
            assert len(per) == 3 and all(len(t) == len(lp) for t, lp, _ in per)
        assert g["logprob_diff"] < TOL, g["logprob_diff"]

    # TP/PP peers of a DP replica hold their leader's generations; DP replicas had different prompts.
    by_dp = {r["dp_rank"]: r["gen"] for r in leaders}
    for r in ranks:
        lead = by_dp[r["dp_rank"]]
        for key in ("prompts", "greedy", "greedy_stop", "sample"):
            assert r["gen"][key] == lead[key], f"rank {r['rank']} disagrees with its DP leader on {key}"
    if len(by_dp) > 1:
        assert by_dp[0]["prompts"] != by_dp[1]["prompts"] and by_dp[0]["sample"] != by_dp[1]["sample"]
