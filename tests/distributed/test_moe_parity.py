"""Mixture-of-experts logits == HF logits at EP2, TP2 x EP2 and PP2 (torchrun/gloo), each rank
reading only its own experts' slices of the safetensors files: Qwen3-MoE, Mixtral, Qwen2-MoE (shared
expert with its gate), GLM-4.5 (sigmoid routing with the expert-score bias, partial RoPE) and
DeepSeek-V3 (multi-latent attention sharded over TP, YaRN, grouped top-k)."""

import pytest

from tests.conftest import read_json

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"]
EXPERTS = {"deepseek_v3": 8}
"""Routed experts of the tiny models (4 unless named)."""
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf_moe")
    save_random_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=3, mlp_only_layers=[1])
    save_random_hf_model(str(root / "mixtral"), "mixtral", seed=4)
    save_random_hf_model(str(root / "qwen2_moe"), "qwen2_moe", seed=5, mlp_only_layers=[2])
    save_random_hf_model(str(root / "glm4_moe"), "glm4_moe", seed=6)
    save_random_hf_model(str(root / "deepseek_v3"), "deepseek_v3", seed=7)
    return str(root)


@pytest.mark.parametrize(
    "tp,pp,ep,nproc,experts",
    [(1, 1, 2, 2, [0, 2]), (2, 1, 2, 4, [0, 0, 2, 2]), (1, 2, 1, 2, [0, 0])],
    ids=["ep2", "tp2ep2", "pp2"],
)
def test_moe_logits_match_hf(hf_models, tmp_path, torchrun, tp, pp, ep, nproc, experts):
    """``experts``: the first (global) expert each rank holds of 4; rank order is tp-ep-dp-pp."""
    out = str(tmp_path / "r.json")
    args = ["--models", hf_models, "--archs", *ARCHS, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]
    torchrun("moe_parity.py", nproc, [*args, "--out", out])
    res = read_json(out)
    assert sorted(res) == sorted(ARCHS)
    for arch, r in res.items():
        assert r["max_logit"] > 1.0, "weights too small to expose a layout bug"
        assert r["max_diff"] < TOL, f"{arch} at TP{tp} PP{pp} EP{ep}: max |logit diff| {r['max_diff']:.2e}"
        n = EXPERTS.get(arch, 4)
        assert r["experts_per_rank"] == [n // ep] * nproc
        assert r["first_expert_per_rank"] == [x * n // 4 for x in experts]
        # every rank reads its own slices: its experts' (and its TP shard / stage), never the model
        # (the tiny models' attention and shared experts weigh as much as half their experts)
        assert max(r["bytes_read_per_rank"]) < 0.8 * r["model_bytes"], r
