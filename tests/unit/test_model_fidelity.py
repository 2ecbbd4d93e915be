"""Model fidelity beyond the plain Llama layout: Llama 3.x RoPE scaling and sliding-window attention.

Llama 3.1/3.2 configs (``rope_scaling.rope_type: llama3``) must give the HF model's logits; any other
RoPE scaling is refused. Sliding windows are refused unless no sequence of the run can exceed them
(full causal attention then equals the window); the logits tests show both sides of that boundary.
"""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.model_args import check_sliding_window, load_model_args, model_args_from_hf_config
from megatron_rl.models.random_hf import save_random_hf_model
from tests.conftest import ROOT

TOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_config(**overrides) -> dict:
    """A small Llama config.json as the Hub writes it (top-level rope_theta, rope_scaling)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 99,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    }
    cfg.update(overrides)
    return cfg


def rewrite_config(src: str, dst: str, edit) -> str:
    """A copy of the HF directory ``src`` at ``dst`` whose config.json went through ``edit``."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def hub_style_rope(rope_scaling):
    """config.json edit: RoPE as Llama 3.x's Hub files write it (rope_theta + rope_scaling)."""

    def edit(cfg):
        params = cfg.pop("rope_parameters", None) or {}
        cfg["rope_theta"] = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        cfg["rope_scaling"] = rope_scaling

    return edit


def megatron_logits(tmp_path, jobs: dict[str, tuple[str, torch.Tensor]]) -> dict[str, dict]:
    """{name: {"logits", "inv_freq"}} of Megatron models built by ``build_model`` from HF directories.

    Runs in a fresh process (a world of one), so that torch.distributed and megatron's groups do
    not outlive it.
    """
    jobs_file, out_file = str(tmp_path / "jobs.pt"), str(tmp_path / "megatron.pt")
    torch.save(jobs, jobs_file)
    code = f"from {__name__} import _megatron_worker; _megatron_worker({jobs_file!r}, {out_file!r})"
    dist_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_env}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH")))), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(
            f"Megatron worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return torch.load(out_file)


def _megatron_worker(jobs_file: str, out_file: str) -> None:
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import run_pipeline
    from megatron_rl.models.loading import load_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ps = init_parallel(1, 1, device="cpu")
    out = {}
    for name, (path, ids) in torch.load(jobs_file).items():
        model = build_model(load_model_args(path), ps, dtype=torch.float32)
        load_weights(model, path, ps)
        model.eval()
        mb = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            (logits,) = run_pipeline(model, ps, [mb], lambda mb, logits: logits, forward_only=True)
        out[name] = {"logits": logits, "inv_freq": model.rotary_pos_emb.inv_freq.clone()}
    torch.save(out, out_file)
    destroy_parallel()


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    return hf_model(path)(input_ids=ids).logits


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------- Llama 3.x RoPE


@pytest.mark.parametrize("factor", [8.0, 32.0], ids=["llama3.1", "llama3.2"])
def test_llama3_rope_scaling_is_read(factor):
    hub = model_args_from_hf_config(hf_config(rope_scaling={**LLAMA3, "factor": factor}))
    assert hub.rope_scaling and hub.rope_scaling_factor == factor and hub.rope_theta == 500000.0
    # transformers 5 writes the same settings under rope_parameters
    v5 = model_args_from_hf_config(
        hf_config(rope_theta=None, rope_parameters={**LLAMA3, "factor": factor, "rope_theta": 500000.0})
    )
    assert v5 == hub
    plain = model_args_from_hf_config(hf_config())
    assert not plain.rope_scaling and plain != hub


@pytest.mark.parametrize(
    "field,value",
    [("low_freq_factor", 2.0), ("high_freq_factor", 8.0), ("original_max_position_embeddings", 64)],
)
def test_llama3_parameters_megatron_fixes_are_refused(field, value):
    """megatron-core's llama3 scaling fixes these three; other values would mis-load silently."""
    with pytest.raises(ValueError) as e:
        model_args_from_hf_config(hf_config(rope_scaling={**LLAMA3, field: value}))
    msg = one_line_error(e)
    assert f"rope_scaling.{field}={value}" in msg and "LlamaForCausalLM" in msg


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    ],
    ids=lambda r: r.get("rope_type", r.get("type")),
)
def test_other_rope_scaling_is_refused(tmp_path, rope_scaling):
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    with pytest.raises(ValueError) as e:
        model_args_from_hf_config(hf_config(rope_scaling=rope_scaling))
    msg = one_line_error(e)
    assert f"rope_scaling.rope_type={kind!r}" in msg and "LlamaForCausalLM" in msg
    # loaded from a directory, the error names the path
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config(rope_scaling=rope_scaling), f)
    with pytest.raises(ValueError) as e:
        load_model_args(str(tmp_path))
    msg = one_line_error(e)
    assert msg.startswith(f"{tmp_path}: rope_scaling.rope_type={kind!r}")


def test_llama3_export_keeps_rope_scaling(tmp_path):
    """The HF writer writes the model's own config back: the scaling survives an export."""
    from ckpt_tools.hf_writer import write_hf
    from megatron_rl.weights.hf_io import HFReader

    src = save_random_hf_model(str(tmp_path / "base"), "llama", num_hidden_layers=2, rope_theta=500000.0)
    src = rewrite_config(src, str(tmp_path / "llama3"), hub_style_rope(LLAMA3))
    args = load_model_args(src)
    write_hf(HFReader(src), args, str(tmp_path / "out"), progress=False)
    back = load_model_args(str(tmp_path / "out"))
    assert back.hf_config["rope_scaling"] == LLAMA3
    assert back.rope_scaling and back.rope_scaling_factor == 8.0


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_scaling_survives_the_legacy_megatron_args(factor):
    """mcore-to-legacy writes Megatron-LM's use_rope_scaling/rope_scaling_factor; reading them back
    gives the same llama3 scaling (a checkpoint without config.json beside it)."""
    from megatron_rl.weights.megatron_args import megatron_args_from_model_args, model_args_from_megatron_args

    args = model_args_from_hf_config(hf_config(rope_scaling={**LLAMA3, "factor": factor}))
    ns = megatron_args_from_model_args(args, 1, 1, args.vocab_size, torch.float32)
    assert ns.use_rope_scaling and ns.rope_scaling_factor == factor
    back = model_args_from_megatron_args(ns, "ckpt")
    assert back.rope_scaling and back.rope_scaling_factor == factor
    plain = model_args_from_megatron_args(
        megatron_args_from_model_args(model_args_from_hf_config(hf_config()), 1, 1, 128, torch.float32),
        "ckpt",
    )
    assert not plain.rope_scaling


def test_llama3_logits_match_hf(tmp_path):
    """Megatron == HF for a Llama 3.1-style scaled RoPE, over 128 positions.

    rope_theta 500000 with head_dim 16 puts half of the rotary frequencies at wavelengths above
    2048 (= 8192 / high_freq_factor), where llama3 scaling changes them; the negative control (the
    same weights with the scaling dropped) must then miss HF by far more than the tolerance.
    """
    base = save_random_hf_model(
        str(tmp_path / "base"), "llama", max_position_embeddings=131072, rope_theta=500000.0
    )
    scaled = rewrite_config(base, str(tmp_path / "scaled"), hub_style_rope(LLAMA3))
    unscaled = rewrite_config(base, str(tmp_path / "unscaled"), hub_style_rope(None))
    ids = torch.randint(0, 99, (2, 128), generator=torch.Generator().manual_seed(0))

    hf = hf_model(scaled)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    meg = megatron_logits(tmp_path, {"scaled": (scaled, ids), "unscaled": (unscaled, ids)})
    got = meg["scaled"]["logits"][..., : ref.shape[-1]]

    hf_freq = hf.model.rotary_emb.inv_freq
    assert (meg["unscaled"]["inv_freq"] != hf_freq).sum() >= 4, "scaling does not change this model's RoPE"
    torch.testing.assert_close(
        meg["scaled"]["inv_freq"],
        hf_freq,
        rtol=1e-6,
        atol=0,
        msg="Megatron's RoPE frequencies are unscaled: build_model must pass ModelArgs.rope_scaling and "
        "rope_scaling_factor to GPTModel",
    )
    assert ref.abs().max() > 1.0, "weights too small to expose a RoPE difference"
    diff = (got - ref).abs().max().item()
    assert diff < TOL, f"llama3-scaled RoPE: max |logit diff| {diff:.2e}"
    miss = (meg["unscaled"]["logits"][..., : ref.shape[-1]] - ref).abs().max().item()
    assert miss > 100 * TOL, f"negative control: unscaled RoPE is only {miss:.2e} off"


# ------------------------------------------------------------------------------- sliding windows


def test_active_sliding_window_is_refused(tmp_path):
    path = save_random_hf_model(str(tmp_path / "mistral"), "mistral", sliding_window=16)
    args = load_model_args(path)
    assert args.sliding_window == 16
    with pytest.raises(ValueError) as e:
        check_sliding_window(args, source=path)
    msg = one_line_error(e)
    assert msg.startswith(f"{path}: sliding_window=16 (attention limited to the last 16 tokens)")
    assert "full causal" in msg and "data.max_prompt_length + data.max_response_length <= 16" in msg
    assert "max_position_embeddings=256" in msg
    # Sequences of the run no longer than the window see exactly full causal attention.
    check_sliding_window(args, max_seq_len=16)
    with pytest.raises(ValueError, match=r"sequences of up to 17 tokens"):
        check_sliding_window(args, max_seq_len=17)


@pytest.mark.parametrize(
    "overrides,window",
    [
        # Mistral-7B-v0.1 and Phi-3-mini-4k
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096,
          "max_position_embeddings": 32768}, 4096),
        ({"architectures": ["Phi3ForCausalLM"], "sliding_window": 2047,
          "max_position_embeddings": 4096}, 2047),
        # HF's Mistral default when config.json names no window
        ({"architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}, 4096),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096,
          "max_window_layers": 1, "max_position_embeddings": 32768}, 4096),
        ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 4096,
          "layer_types": ["full_attention", "sliding_attention"], "max_position_embeddings": 32768}, 4096),
    ],
    ids=["mistral-7b-v0.1", "phi3-mini-4k", "mistral-default", "qwen2-window-layers", "qwen3-layer-types"],
)  # fmt: skip
def test_real_world_active_windows(overrides, window):
    args = model_args_from_hf_config(hf_config(**overrides))
    assert args.sliding_window == window
    with pytest.raises(ValueError) as e:
        check_sliding_window(args)
    assert one_line_error(e).startswith(f"{overrides['architectures'][0]}: sliding_window={window} ")
    check_sliding_window(args, max_seq_len=window)


@pytest.mark.parametrize(
    "overrides",
    [
        # Qwen2.5 on the Hub: a window that is switched off
        {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 16,
         "max_window_layers": 0},
        {"architectures": ["Qwen3ForCausalLM"], "sliding_window": 16},
        # switched on, but no layer at or past max_window_layers
        {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 16,
         "max_window_layers": 2},
        {"architectures": ["MistralForCausalLM"], "sliding_window": None},
        {"architectures": ["LlamaForCausalLM"], "sliding_window": 16},
    ],
    ids=["qwen2-off", "qwen3-off", "qwen2-no-window-layer", "mistral-null", "llama"],
)  # fmt: skip
def test_inactive_windows_load(overrides):
    args = model_args_from_hf_config(hf_config(max_position_embeddings=256, **overrides))
    assert args.sliding_window is None
    check_sliding_window(args)
    check_sliding_window(args, max_seq_len=100_000)


def test_window_at_least_max_positions_loads(tmp_path):
    path = save_random_hf_model(str(tmp_path / "mistral"), "mistral", sliding_window=256)
    args = load_model_args(path)
    assert args.max_position_embeddings == 256
    check_sliding_window(args, source=path)
    with pytest.raises(ValueError):
        check_sliding_window(args, max_seq_len=257)


def test_qwen2_inactive_window_logits_match_hf(tmp_path):
    """A Hub-style Qwen2 config (use_sliding_window false, window 16) is full causal in HF too."""
    base = save_random_hf_model(str(tmp_path / "base"), "qwen2")
    path = rewrite_config(
        base, str(tmp_path / "qwen2"), lambda c: c.update(use_sliding_window=False, sliding_window=16)
    )
    check_sliding_window(load_model_args(path), max_seq_len=48, source=path)
    ids = torch.randint(0, 99, (2, 48), generator=torch.Generator().manual_seed(1))
    got = megatron_logits(tmp_path, {"q": (path, ids)})["q"]["logits"][..., :99]
    diff = (got - hf_logits(path, ids)).abs().max().item()
    assert diff < TOL, f"qwen2 with an inactive window: max |logit diff| {diff:.2e}"


def test_sliding_window_boundary(tmp_path):
    """Why the rule is max_seq_len <= window: Megatron's full causal attention equals HF's Mistral
    with sliding_window=16 for 16 tokens, and differs from it past the window."""
    path = save_random_hf_model(str(tmp_path / "mistral"), "mistral", sliding_window=16)
    ids = torch.randint(0, 99, (2, 32), generator=torch.Generator().manual_seed(2))
    meg = megatron_logits(tmp_path, {"short": (path, ids[:, :16]), "long": (path, ids)})
    short = (meg["short"]["logits"][..., :99] - hf_logits(path, ids[:, :16])).abs().max().item()
    assert short < TOL, f"within the window: max |logit diff| {short:.2e}"
    ref = hf_logits(path, ids)
    inside = (meg["long"]["logits"][:, :16, :99] - ref[:, :16]).abs().max().item()
    past = (meg["long"]["logits"][:, 16:, :99] - ref[:, 16:]).abs().max().item()
    assert inside < TOL and past > 100 * TOL, (inside, past)
