"""Mixture-of-experts logits == HF logits at EP2, TP2 x EP2 and PP2 (torchrun/gloo), each rank
reading only its own experts' slices of the safetensors files."""

import pytest

from tests.conftest import read_json

ARCHS = ["qwen3_moe", "mixtral"]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf_moe")
    save_random_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=3, mlp_only_layers=[1])
    save_random_hf_model(str(root / "mixtral"), "mixtral", seed=4)
    return str(root)


@pytest.mark.parametrize(
    "tp,pp,ep,nproc,experts",
    [(1, 1, 2, 2, [0, 2]), (2, 1, 2, 4, [0, 0, 2, 2]), (1, 2, 1, 2, [0, 0])],
    ids=["ep2", "tp2ep2", "pp2"],
)
def test_moe_logits_match_hf(hf_models, tmp_path, torchrun, tp, pp, ep, nproc, experts):
    """``experts``: the first (global) expert each rank holds; rank order is tp-ep-dp-pp."""
    out = str(tmp_path / "r.json")
    args = ["--models", hf_models, "--archs", *ARCHS, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]
    torchrun("moe_parity.py", nproc, [*args, "--out", out])
    res = read_json(out)
    assert sorted(res) == sorted(ARCHS)
    for arch, r in res.items():
        assert r["max_logit"] > 1.0, "weights too small to expose a layout bug"
        assert r["max_diff"] < TOL, f"{arch} at TP{tp} PP{pp} EP{ep}: max |logit diff| {r['max_diff']:.2e}"
        assert r["experts_per_rank"] == [4 // ep] * nproc
        assert r["first_expert_per_rank"] == experts
        # every rank reads its own slices: its experts' (and its TP shard / stage), never the model
        assert max(r["bytes_read_per_rank"]) < 0.75 * r["model_bytes"], r
