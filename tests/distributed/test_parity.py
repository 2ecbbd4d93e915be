"""Megatron logits == HF logits for every architecture at TP1, TP2, PP2 and TP2xPP2 (torchrun/gloo)."""

import pytest

from tests.conftest import read_json

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3"]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf")
    for i, arch in enumerate(ARCHS):
        # Qwen2.5's small models tie embeddings; cover both head layouts.
        save_random_hf_model(str(root / arch), arch, seed=i, tie_word_embeddings=arch == "qwen2")
    return str(root)


LAYOUTS = {  # id: (tp, pp, attention)
    "tp1": (1, 1, "sdpa"),
    "tp2": (2, 1, "sdpa"),
    "pp2": (1, 2, "sdpa"),
    "tp2pp2": (2, 2, "sdpa"),
    "tp2-unfused-attention": (2, 1, "unfused"),
}
CORRUPT = {"qkv": 1, "fc1": 2}  # the wrong layout: TP


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory) -> dict[str, dict]:
    """{layout id or corrupt kind: the worker's result}: one launch per process count."""
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("parity")
    launches: dict[int, list[tuple[str, list[str]]]] = {}
    for name, (tp, pp, attention) in LAYOUTS.items():
        args = ["--models", hf_models, "--archs", *ARCHS, "--tp", str(tp), "--pp", str(pp)]
        launches.setdefault(tp * pp, []).append((name, [*args, "--attention", attention]))
    for corrupt, tp in CORRUPT.items():
        args = ["--models", hf_models, "--archs", "llama", "phi3", "--tp", str(tp), "--corrupt", corrupt]
        launches.setdefault(tp, []).append((corrupt, args))
    for nproc, runs in launches.items():
        run_torchrun_runs(
            "parity", nproc, [[*args, "--out", str(root / f"{name}.json")] for name, args in runs]
        )
    return {name: read_json(str(root / f"{name}.json")) for runs in launches.values() for name, _ in runs}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_hf(results, layout):
    """Both core attentions (torch SDPA, megatron's unfused) against the HF oracle."""
    tp, pp, _ = LAYOUTS[layout]
    res = results[layout]
    assert sorted(res) == sorted(ARCHS)
    for arch, r in res.items():
        assert r["max_logit"] > 1.0, "weights too small to expose a layout bug"
        assert r["max_diff"] < TOL, f"{arch} at TP{tp} PP{pp}: max |logit diff| {r['max_diff']:.2e}"
        if tp * pp > 1:
            # Each rank reads its own slices; none materialises the whole model.
            assert max(r["bytes_read_per_rank"]) < 0.75 * r["model_bytes"], r


@pytest.mark.parametrize("corrupt,tp", list(CORRUPT.items()))
def test_wrong_layout_is_caught(results, corrupt, tp):
    """Negative control: the parity check fails for the usual qkv / fc1 layout mistakes."""
    for arch, r in results[corrupt].items():
        assert r["max_diff"] > 100 * TOL, f"{arch}: a wrong {corrupt} layout went unnoticed"
