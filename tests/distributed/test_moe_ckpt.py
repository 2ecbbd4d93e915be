"""ckpt_tools with a mixture-of-experts model (Qwen3-MoE; DeepSeek-V3 with its multi-latent attention,
expert-score biases and shared experts; GLM-4.5; Qwen2-MoE with its gated shared expert): HF ->
torch_dist at EP2 (each of the two ranks saves its own experts) -> HF is bit-exact; ``verify --ep 2``
passes the checkpoint against its HF model and fails it against another; --ep that does not divide
the experts stops in one line."""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


def ckpt_tools(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))),
        "OMP_NUM_THREADS": "1",
    }
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_tools", *args], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != expect:
        pytest.fail(
            f"ckpt_tools {args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


DIMS = {"qwen3_moe": dict(mlp_only_layers=[2]), "deepseek_v3": {}, "glm4_moe": {}, "qwen2_moe": {}}


@pytest.mark.slow  # over 45 s: `make test-slow` (CI runs it)
@pytest.mark.parametrize("arch", list(DIMS))
def test_hf_to_mcore_at_ep2_and_back_is_bit_exact(tmp_path, arch):
    from safetensors.torch import load_file

    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.weights.ckpt_format import METADATA_FILE

    hf = save_random_hf_model(str(tmp_path / "hf"), arch, seed=5, **DIMS[arch])
    mcore, back = str(tmp_path / "mcore_ep2"), str(tmp_path / "back")
    ckpt_tools("hf-to-mcore", "--ep", "2", "--hf", hf, "--out", mcore)
    meta = __import__("json").load(open(os.path.join(mcore, METADATA_FILE)))
    assert (meta["tp"], meta["pp"], meta["ep"]) == (1, 1, 2)
    ckpt_tools("mcore-to-hf", "--ckpt", mcore, "--out", back)
    want, got = (
        load_file(os.path.join(hf, "model.safetensors")),
        load_file(os.path.join(back, "model.safetensors")),
    )
    assert set(got) == set(want)
    assert any(".mlp.experts.3." in k for k in want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name

    ok = ckpt_tools("verify", "--ep", "2", "--hf", hf, "--ckpt", mcore, "--tol", "1e-4")
    assert "EP=2" in ok.stdout + ok.stderr and "OK" in ok.stdout + ok.stderr
    other = save_random_hf_model(str(tmp_path / "other"), arch, seed=6, **DIMS[arch])
    bad = ckpt_tools("verify", "--ep", "2", "--hf", other, "--ckpt", mcore, "--tol", "1e-4", expect=1)
    assert "FAILED" in bad.stdout + bad.stderr


def test_ep_must_divide_the_experts(tmp_path):
    from megatron_rl.models.random_hf import save_random_hf_model

    hf = save_random_hf_model(str(tmp_path / "hf"), "qwen3_moe", seed=5)
    proc = ckpt_tools("hf-to-mcore", "--ep", "3", "--hf", hf, "--out", str(tmp_path / "x"), expect=1)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ckpt_tools: ") and "--ep 3 does not divide its 4 experts" in last
