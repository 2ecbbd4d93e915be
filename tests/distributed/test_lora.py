"""LoRA on megatron's parallel linears (models/lora.py) against PEFT on the HF model, the oracle: a tiny
Qwen2 (q/k/v biases) with O(1) random weights and PEFT adapters of rank 4 with O(1) random A and B (one
A per fused linear: q/k/v share theirs, gate/up theirs). One launch of 2 gloo ranks (workers/lora.py)
runs TP1, TP2 and TP2 with sequence parallelism; each must give PEFT's logits and gradients. Negative
controls: every B zeroed gives the base model exactly, one A perturbed moves the logits. Also: the
adapters switched off are the base (the reference policy), the engine's stream is PEFT's merged
weights, a checkpoint holds the adapters only and loads at another TP, and ckpt_tools export-peft
writes what PeftModel loads back to the trainer's logits."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import run_torchrun

TOL = 1e-4  # fp32, different summation orders
GRAD_RTOL = 5e-3  # of the largest element: O(1) weights through 4 layers amplify fp32 rounding ...
GRAD_ATOL = 1e-3  # ... and the saturated attention of the last layer leaves tiny, noisy q gradients
LAYOUTS = ("tp1", "tp2", "tp2sp")
RANK, ALPHA = 4, 8.0
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""HF projections that are one megatron linear: one adapter, one A."""


def _peft_model(path: str, seed: int):
    """PEFT on the HF model at ``path`` with random O(1) adapters; fused-linear projections share A."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            for group in (
                [att.q_proj, att.k_proj, att.v_proj],
                [att.o_proj],
                [mlp.gate_proj, mlp.up_proj],
                [mlp.down_proj],
            ):
                a = torch.randn(group[0].lora_A["default"].weight.shape, generator=g)
                for m in group:
                    m.lora_A["default"].weight.copy_(a)
                    m.lora_B["default"].weight.copy_(
                        torch.randn(m.lora_B["default"].weight.shape, generator=g)
                    )
    return model


def _tokens(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("lora")
    path = save_random_hf_model(str(root / "qwen2"), "qwen2", seed=7)
    peft = _peft_model(path, seed=11)
    peft.save_pretrained(str(root / "peft"))
    ids, mask = _tokens(99)  # TINY's vocabulary
    out = peft(input_ids=ids, attention_mask=mask).logits  # [2, 12, V]
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)) * mask[..., None]
    (out * proj).sum().backward()
    oracle = {
        "logits": out.detach(),
        "grads": {n: p.grad.clone() for n, p in peft.named_parameters() if "lora_" in n},
        "merged": {n: t.clone() for n, t in peft.merge_and_unload().state_dict().items()},
    }
    res = str(root / "res.pt")
    ckpt = str(root / "ckpt")
    run_torchrun("lora.py", 2, ["--model", path, "--peft", str(root / "peft"), "--ckpt", ckpt, "--out", res])
    return {"root": root, "path": path, "ckpt": ckpt, "oracle": oracle, "res": torch.load(res), "mask": mask}


def _real(x, mask):
    return x[mask.bool()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_logits_and_grads_equal_peft(lora, layout):
    r, o, mask = lora["res"][layout], lora["oracle"], lora["mask"]
    assert _real(o["logits"], mask).abs().max() > 1.0, "weights too small to expose a layout bug"
    diff = (_real(r["logits"], mask) - _real(o["logits"], mask)).abs().max().item()
    assert diff < TOL * 10, f"{layout}: logits differ from PEFT's by {diff:.2e}"
    # PEFT's names carry the adapter name; a fused linear's A gradient is the sum of its projections'
    peft_grads = {n.replace(".default", ""): g for n, g in o["grads"].items()}
    for name, g in r["grads"].items():
        want = peft_grads[name]
        if name.endswith("lora_A.weight"):
            parent, leaf = name.rsplit(".", 2)[0].rsplit(".", 1)
            shared = next((f for f in FUSED if leaf in f), (leaf,))
            want = sum(peft_grads[f"{parent}.{m}.lora_A.weight"] for m in shared)
        scale = want.abs().max().item()
        assert scale > 0
        err = (g - want).abs().max().item()
        assert err < GRAD_RTOL * scale + GRAD_ATOL, f"{layout}: {name} off by {err:.2e} (max {scale:.2e})"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_controls_and_reference(lora, layout):
    r, mask = lora["res"][layout], lora["mask"]
    assert torch.equal(r["b_zero"], r["base"]), "B zeroed must give the base model exactly"
    assert torch.equal(r["disabled"], r["base"]), "adapters off must be the base model (the reference)"
    assert (_real(r["a_perturbed"] - r["logits"], mask)).abs().max() > 100 * TOL, (
        "a perturbed A went unnoticed"
    )
    assert (_real(r["logits"] - r["base"], mask)).abs().max() > 100 * TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stream_is_peft_merged(lora, layout):
    stream, merged = lora["res"][layout]["stream"], lora["oracle"]["merged"]
    assert set(stream) == set(merged)
    worst = max(stream, key=lambda n: (stream[n] - merged[n]).abs().max().item())
    assert (stream[worst] - merged[worst]).abs().max().item() < TOL, worst
    assert not torch.equal(stream["model.layers.0.self_attn.q_proj.weight"], lora["res"]["tp1"]["base"][:0])


def test_checkpoint_holds_adapters_only_and_reloads_at_another_tp(lora):
    from megatron_rl.weights.ckpt_format import read_our_metadata, resolve_torch_dist
    from megatron_rl.weights.safe_load import check_torch_dist

    meta, _ = check_torch_dist(lora["ckpt"])
    keys = set(meta.state_dict_metadata)
    assert keys and all("_lora." in k for k in keys), sorted(keys)[:5]
    ours = read_our_metadata(resolve_torch_dist(lora["ckpt"]))
    assert ours["lora"]["rank"] == RANK and ours["lora"]["base"] == lora["path"]
    tp2, reloaded = lora["res"]["tp2"]["weights"], lora["res"]["reload"]["weights"]
    for name, t in tp2.items():
        assert torch.equal(reloaded[name], t), name
    assert "holds LoRA adapters" in lora["res"]["reload"]["refusal"]
    assert all("_lora." in n for n in lora["res"]["tp2"]["trainable"])
    assert lora["res"]["tp2"]["frozen_with_grad"] == []


def test_export_peft_round_trip(lora):
    """ckpt_tools export-peft -> PeftModel.from_pretrained on the HF model -> the trainer's logits; and
    --merged -> an HF model with the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = str(lora["root"] / "exported")
    merged = str(lora["root"] / "merged")
    for extra, dest in (([], out), (["--merged"], merged)):
        cmd = [
            sys.executable,
            "-m",
            "ckpt_tools",
            "export-peft",
            "--ckpt",
            lora["ckpt"],
            "--out",
            dest,
            *extra,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert json.load(f)["r"] == RANK
    ids, mask = _tokens(99)
    trainer = lora["res"]["tp2"]["logits"]
    hf = AutoModelForCausalLM.from_pretrained(lora["path"], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got = PeftModel.from_pretrained(hf, out)(input_ids=ids, attention_mask=mask).logits
        flat = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, attn_implementation="eager")
        got_merged = flat(input_ids=ids, attention_mask=mask).logits
    assert (_real(got - trainer, mask)).abs().max().item() < TOL * 10
    assert (_real(got_merged - trainer, mask)).abs().max().item() < TOL * 10
