"""LoRA on a mixture-of-experts model (models/lora.py ExpertAdapters): a tiny Qwen2-MoE (q/k/v biases, a
gated shared expert, 4 routed experts) with O(1) random weights and adapters on attention, the shared
expert and every routed expert (workers/lora_moe.py, 2 gloo ranks: EP1, EP2, TP2 with expert TP 1).
The oracle is the HF model holding the weights the engine receives (W + scale * B @ A, streamed): its
logits must be the trainer's, whose adapters run beside the weights through the grouped matmuls. The
layouts must agree on logits and on every adapter's gradient; one routed expert's B zeroed must move
the logits; the adapters off are the base; a checkpoint at EP2 loads at EP1; expert TP 2 is refused;
export-peft refuses expert adapters and --merged writes an HF model with the trainer's logits."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import run_torchrun
from tests.distributed.test_lora import ALPHA, RANK, _real, _tokens

TOL = 1e-3  # fp32: O(1) weights through the routers and 4 layers
LAYOUTS = ("ep1", "ep2", "tp2")


def _peft_dir(path: str, out: str) -> None:
    """PEFT adapters with O(1) random A and B on attention and the shared expert (one A per fused
    linear: q/k/v share theirs, gate/up theirs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            att, sh = layer.self_attn, layer.mlp.shared_expert
            for group in (
                [att.q_proj, att.k_proj, att.v_proj],
                [att.o_proj],
                [sh.gate_proj, sh.up_proj],
                [sh.down_proj],
            ):
                a = torch.randn(group[0].lora_A["default"].weight.shape, generator=g)
                for m in group:
                    m.lora_A["default"].weight.copy_(a)
                    m.lora_B["default"].weight.copy_(
                        torch.randn(m.lora_B["default"].weight.shape, generator=g)
                    )
    model.save_pretrained(out)


def _hf_logits(path: str, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The HF model at ``path`` (its weights replaced by ``weights``, checkpoint names) on the tokens."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.model_args import load_model_args
    from megatron_rl.weights.tables import module_param_views

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if weights is not None:
        views = module_param_views(load_model_args(path), dict(hf.named_parameters()))
        with torch.no_grad():
            for name, t in weights.items():
                views[name].copy_(t)
    ids, mask = _tokens(99)
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("lora_moe")
    path = save_random_hf_model(str(root / "qwen2_moe"), "qwen2_moe", seed=7)
    _peft_dir(path, str(root / "peft"))
    res, ckpt = str(root / "res.pt"), str(root / "ckpt")
    run_torchrun(
        "lora_moe.py", 2, ["--model", path, "--peft", str(root / "peft"), "--ckpt", ckpt, "--out", res]
    )
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
