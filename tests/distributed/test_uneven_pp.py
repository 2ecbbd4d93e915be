"""Uneven pipelines (megatron's num_layers_in_first/last_pipeline_stage, verl's
``*.megatron.override_transformer_config`` keys): logits equal the HF model's at PP2 with a short
first or last stage and at PP3 with both, for a dense model, a Qwen3-MoE with a dense layer and a
DeepSeek-V3 (its first layer dense); a stage reading a layer twice (and its own never) must fail; the
torch_dist checkpoint saved at an uneven split converts back to the HF files bit for bit."""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, read_json

ARCHS = ["llama", "qwen3_moe", "deepseek_v3"]
TOL = 1e-4

# id: (pp, first, last, corrupt)
LAYOUTS = {
    "pp2_first1": (2, 1, None, None),
    "pp2_last2": (2, None, 2, None),
    "pp3_first1_last1": (3, 1, 1, None),
    "pp2_first1_duplicated": (2, 1, None, "duplicate"),
}
SPLITS = {"pp2_first1": [1, 5], "pp2_last2": [4, 2], "pp3_first1_last1": [1, 4, 1]}


def save_models(root, num_layers: int) -> str:
    """A Llama, a Qwen3-MoE (layer 3 dense) and a DeepSeek-V3 (layer 0 dense) of ``num_layers`` layers
    under ``root``/<arch>: the models the pipeline-layout tests split."""
    from megatron_rl.models.random_hf import save_random_hf_model

    save_random_hf_model(str(root / "llama"), "llama", seed=1, num_hidden_layers=num_layers)
    save_random_hf_model(
        str(root / "qwen3_moe"), "qwen3_moe", seed=2, num_hidden_layers=num_layers, mlp_only_layers=[3]
    )
    dsv3 = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)
    save_random_hf_model(
        str(root / "deepseek_v3"), "deepseek_v3", seed=3, num_hidden_layers=num_layers, **dsv3
    )
    return str(root)


def assert_converts_to_hf(ckpt: str, hf_dir: str, out: str) -> None:
    """``ckpt_tools mcore-to-hf`` of the torch_dist checkpoint ``ckpt`` gives ``hf_dir``'s tensors bit
    for bit."""
    from safetensors.torch import load_file

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "ckpt_tools", "mcore-to-hf", "--ckpt", ckpt, "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = load_file(os.path.join(hf_dir, "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert set(got) == set(want), ckpt
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{ckpt}: {name}"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("hf_uneven"), 6)


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory) -> tuple[dict[str, dict], str]:
    """({layout id: the worker's result}, the checkpoints saved at pp2_first1): one launch per
    process count."""
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("uneven")
    saved = str(root / "ckpt")
    launches: dict[int, list[list[str]]] = {}
    for name, (pp, first, last, corrupt) in LAYOUTS.items():
        argv = [
            "--models",
            hf_models,
            "--archs",
            *ARCHS,
            "--pp",
            str(pp),
            "--out",
            str(root / f"{name}.json"),
        ]
        argv += ["--first", str(first)] if first else []
        argv += ["--last", str(last)] if last else []
        argv += ["--corrupt", corrupt] if corrupt else []
        argv += ["--save", saved] if name == "pp2_first1" else []
        launches.setdefault(pp, []).append(argv)
    for nproc, runs in launches.items():
        run_torchrun_runs("uneven_pp", nproc, runs)
    return {name: read_json(str(root / f"{name}.json")) for name in LAYOUTS}, saved


@pytest.mark.parametrize("layout", list(SPLITS))
def test_uneven_stages_match_hf(results, layout):
    res, _ = results
    for arch in ARCHS:
        r = res[layout][arch]
        assert r["stage_layers"] == SPLITS[layout]
        assert r["layer_offset_per_rank"] == [sum(SPLITS[layout][:i]) for i in range(len(SPLITS[layout]))]
        assert r["max_logit"] > 1.0, "weights too small to expose a layout bug"
        assert r["max_diff"] < TOL, f"{arch} at {layout}: max |logit diff| {r['max_diff']:.2e}"


def test_a_duplicated_layer_is_seen(results):
    res, _ = results
    for arch in ARCHS:
        assert res["pp2_first1_duplicated"][arch]["max_diff"] > 100 * TOL, arch


def test_a_checkpoint_saved_at_an_uneven_split_converts_back_bit_exact(results, hf_models, tmp_path):
    _, saved = results
    for arch in ("llama", "deepseek_v3"):
        assert_converts_to_hf(os.path.join(saved, arch), os.path.join(hf_models, arch), str(tmp_path / arch))
