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


@pytest.mark.parametrize(
    "tp,pp,attention",
    [(1, 1, "sdpa"), (2, 1, "sdpa"), (1, 2, "sdpa"), (2, 2, "sdpa"), (2, 1, "unfused")],
    ids=["tp1", "tp2", "pp2", "tp2pp2", "tp2-unfused-attention"],
)
def test_logits_match_hf(hf_models, tmp_path, torchrun, tp, pp, attention):
    """Both core attentions (torch SDPA, megatron's unfused) against the HF oracle."""
    out = str(tmp_path / "r.json")
    args = [
        "--models",
        hf_models,
        "--archs",
        *ARCHS,
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--attention",
        attention,
    ]
    torchrun("parity.py", tp * pp, [*args, "--out", out])
    res = read_json(out)
    assert sorted(res) == sorted(ARCHS)
    for arch, r in res.items():
        assert r["max_logit"] > 1.0, "weights too small to expose a layout bug"
        assert r["max_diff"] < TOL, f"{arch} at TP{tp} PP{pp}: max |logit diff| {r['max_diff']:.2e}"
        if tp * pp > 1:
            # Each rank reads its own slices; none materialises the whole model.
            assert max(r["bytes_read_per_rank"]) < 0.75 * r["model_bytes"], r


@pytest.mark.parametrize("corrupt,tp", [("qkv", 1), ("fc1", 2)])
def test_wrong_layout_is_caught(hf_models, tmp_path, torchrun, corrupt, tp):
    """Negative control: the parity check fails for the usual qkv / fc1 layout mistakes."""
    out = str(tmp_path / "r.json")
    torchrun(
        "parity.py",
        tp,
        [
            "--models",
            hf_models,
            "--archs",
            "llama",
            "phi3",
            "--tp",
            str(tp),
            "--corrupt",
            corrupt,
            "--out",
            out,
        ],
    )
    for arch, r in read_json(out).items():
        assert r["max_diff"] > 100 * TOL, f"{arch}: a wrong {corrupt} layout went unnoticed"
