"""LoRA on mixture-of-experts models (models/lora.py ExpertAdapters): a tiny Qwen2-MoE (q/k/v biases, a
gated shared expert, 4 routed experts) and a tiny DeepSeek-V3 (multi-latent attention with q LoRA,
YaRN, sigmoid routing, a shared expert, a dense first layer), O(1) random weights, adapters on
attention, the dense and shared MLPs and every routed expert (workers/lora_moe.py, 2 gloo ranks: EP1,
EP2, TP2 with expert TP 1).
The oracle is the HF model holding the weights the engine receives (W + scale * B @ A, streamed): its
logits must be the trainer's, whose adapters run beside the weights through the grouped matmuls. The
layouts must agree on logits and on every adapter's gradient; one routed expert's B zeroed must move
the logits; the adapters off are the base; a checkpoint at EP2 loads at EP1; expert TP 2 is refused;
export-peft refuses expert adapters and --merged writes an HF model with the trainer's logits."""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import run_torchrun
from tests.distributed.test_lora import RANK, _real, _tokens

TOL = 1e-3  # fp32: O(1) weights through the routers and 4 layers
LAYOUTS = ("ep1", "ep2", "tp2")


ARCHS = ("qwen2_moe", "deepseek_v3")
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""HF projections that are one megatron linear: one adapter, so one A."""


def _peft_dir(path: str, out: str) -> None:
    """Adapters in PEFT's names with O(1) random A and B on every nn.Linear of attention, the dense MLPs
    and the shared experts (the projections of one fused linear share their A). Written directly:
    PEFT's own handling of transformers' fused experts would also target those."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    skip = (".experts.", "lm_head", "shared_expert_gate")
    by_parent: dict[str, dict[str, torch.nn.Linear]] = {}
    for name, m in hf.named_modules():
        router = name.endswith(".mlp.gate")
        if isinstance(m, torch.nn.Linear) and not router and not any(x in name + "." for x in skip):
            parent, leaf = name.rsplit(".", 1)
            by_parent.setdefault(parent, {})[leaf] = m
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for parent, leaves in by_parent.items():
        groups = [[x for x in f if x in leaves] for f in FUSED]
        groups += [[x] for x in leaves if not any(x in f for f in FUSED)]
        for group in (gr for gr in groups if gr):
            a = torch.randn(RANK, leaves[group[0]].in_features, generator=g)
            for x in group:
                key = f"base_model.model.{parent}.{x}"
                tensors[f"{key}.lora_A.weight"] = a.clone()
                tensors[f"{key}.lora_B.weight"] = torch.randn(leaves[x].out_features, RANK, generator=g)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))


def _hf_logits(path: str, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The HF model at ``path`` (its weights replaced by ``weights``, checkpoint names) on the tokens."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.model_args import load_model_args
    from megatron_rl.weights.tables import module_param_views

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if weights is not None:
        named = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}  # + the expert-score bias
        views = module_param_views(load_model_args(path), named)
        with torch.no_grad():
            for name, t in weights.items():
                views[name].copy_(t)
    ids, mask = _tokens(99)
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(scope="module", params=ARCHS)
def moe(request, tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    arch = request.param
    root = tmp_path_factory.mktemp(f"lora_{arch}")
    path = save_random_hf_model(str(root / arch), arch, seed=7)
    _peft_dir(path, str(root / "peft"))
    res, ckpt = str(root / "res.pt"), str(root / "ckpt")
    args = ["--model", path, "--peft", str(root / "peft"), "--ckpt", ckpt, "--out", res]
    run_torchrun("lora_moe.py", 2, args)
    return {"root": root, "path": path, "ckpt": ckpt, "res": torch.load(res), "mask": _tokens(99)[1]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_equals_hf_with_the_streamed_weights(moe, layout):
    r, mask = moe["res"][layout], moe["mask"]
    want = _hf_logits(moe["path"], r["stream"])
    assert _real(want, mask).abs().max() > 1.0, "weights too small to expose a layout bug"
    diff = (_real(r["logits"] - want, mask)).abs().max().item()
    assert diff < TOL, (
        f"{layout}: trainer logits differ from the HF model with the merged weights by {diff:.2e}"
    )
    assert (_real(r["logits"] - r["base"], mask)).abs().max() > 100 * TOL, "the adapters changed nothing"


@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_layouts_agree(moe, layout):
    ref, r, mask = moe["res"]["ep1"], moe["res"][layout], moe["mask"]
    assert (_real(r["logits"] - ref["logits"], mask)).abs().max().item() < TOL
    assert r["grads"].keys() == ref["grads"].keys()
    assert any(".A1" in k for k in r["grads"]) and any("shared_expert" in k for k in r["grads"])
    assert any("self_attn" in k for k in r["grads"])
    for name, g in r["grads"].items():
        scale = ref["grads"][name].abs().max().item()
        assert (g - ref["grads"][name]).abs().max().item() < 5e-3 * scale + 1e-3, f"{layout}: {name}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_controls(moe, layout):
    r, mask = moe["res"][layout], moe["mask"]
    assert torch.equal(r["disabled"], r["base"]), "adapters off must be the base model (the reference)"
    moved = (_real(r["expert_b_zero"] - r["logits"], mask)).abs().max().item()
    assert moved > 100 * TOL, "zeroing a routed expert's adapter went unnoticed"


def test_checkpoint_reloads_at_another_ep_and_exports_merged(moe):
    ep2, reloaded = moe["res"]["ep2"]["weights"], moe["res"]["reload"]
    assert ep2.keys() == reloaded.keys()
    for name, t in ep2.items():
        assert torch.equal(reloaded[name], t), name
    assert "expert_tensor_parallel_size=1" in moe["res"]["etp2"]
    out, merged = str(moe["root"] / "peft_out"), str(moe["root"] / "merged")
    cmd = [sys.executable, "-m", "ckpt_tools", "export-peft", "--ckpt", moe["ckpt"], "--out"]
    refused = subprocess.run([*cmd, out], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "--merged" in refused.stderr, refused.stderr[-1000:]
    p = subprocess.run([*cmd, merged, "--merged"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got, mask = _hf_logits(merged), moe["mask"]
    assert (_real(got - moe["res"]["ep2"]["logits"], mask)).abs().max().item() < TOL
