"""Mixture-of-experts models (Qwen3-MoE, Mixtral) from HF directories, in one process (TP1/EP1).

Logits parity with the HF model at O(1) random weights (each token's routing then depends on its
hidden state and a wrong expert order changes the logits by O(1)); the negative control reads two
experts' weights into each other's place and must fail. The config mapping (which layers are MoE,
the softmax/top-k variant) and the expert-parallel split of the weight table are checked by hand.
DeepSeek-V3 is refused in one line.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_rl.model_args import model_args_from_hf_config
from megatron_rl.models.random_hf import save_random_hf_model
from megatron_rl.weights.tables import hf_shapes, iter_stage_layouts, param_layouts
from tests.conftest import ROOT

TOL = 1e-4

# name -> (arch, config overrides): every routing variant and a mixed dense/MoE layer pattern
MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(mlp_only_layers=[1])),  # norm_topk_prob, layer 1 dense
    "qwen3_moe_softmax_topk": ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("mixtral", {}),
}


def qwen3_moe_config(**overrides) -> dict:
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 99,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    }
    cfg.update(overrides)
    return cfg


def test_moe_layer_pattern_and_routing_are_read():
    a = model_args_from_hf_config(qwen3_moe_config(mlp_only_layers=[0, 3], decoder_sparse_step=1))
    assert a.arch == "qwen3_moe" and a.qk_norm and a.num_experts == 8 and a.moe_top_k == 2
    assert a.moe_layers == (False, True, True, False, True, True)
    assert a.moe_ffn_hidden_size == 32 and a.moe_norm_topk_prob
    b = model_args_from_hf_config(qwen3_moe_config(decoder_sparse_step=2, norm_topk_prob=False))
    assert b.moe_layers == (False, True, False, True, False, True) and not b.moe_norm_topk_prob
    # transformers 5 writes the expert count under Mixtral's name
    cfg = qwen3_moe_config()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert model_args_from_hf_config(cfg).num_experts == 8
    # active parameters: 2 of 8 experts per MoE layer
    per_expert = 3 * 64 * 32
    assert a.num_params() - a.num_active_params() == 4 * 6 * per_expert
    mix = {**qwen3_moe_config(), "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}
    m = model_args_from_hf_config(mix)
    assert m.arch == "mixtral" and m.moe_layers == (True,) * 6 and m.moe_ffn_hidden_size == 96
    assert m.moe_norm_topk_prob and not m.qk_norm


def test_deepseek_v3_is_refused_in_one_line():
    cfg = {**qwen3_moe_config(), "architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}
    with pytest.raises(ValueError) as e:
        model_args_from_hf_config(cfg, source="/models/DeepSeek-V3")
    msg = str(e.value)
    assert "\n" not in msg and "DeepseekV3ForCausalLM" in msg and "multi-latent attention" in msg


def test_expert_parallel_split_of_the_table():
    """EP rank r holds experts [r*E/EP, (r+1)*E/EP) of every MoE layer, whole; everything else is on
    every EP rank; expert matrices split over the expert-TP ranks as dense MLPs over TP."""
    args = model_args_from_hf_config(qwen3_moe_config(mlp_only_layers=[0]))
    full = {lay.name for lay in param_layouts(args, 1)}
    experts_of = {}
    for r in range(4):
        names = {lay.name for lay in iter_stage_layouts(args, 1, 1, 0, ep=4, ep_rank=r)}
        experts_of[r] = sorted(
            {int(m.group(1)) for n in names if (m := re.search(r"local_experts\.(\d+)", n))}
        )
        shared = {n for n in full if "local_experts" not in n}
        assert shared <= names
    assert experts_of == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}
    lays = {lay.name: lay for lay in param_layouts(args, 2, etp=2)}
    fc1 = lays["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert fc1.expert == 5 and fc1.shard_rows == 32 and len(fc1.pieces) == 2
    assert [p.hf_name.split(".")[-2] for p in fc1.pieces[1]] == ["gate_proj", "up_proj"]
    assert (fc1.pieces[1][0].start, fc1.pieces[1][0].stop) == (16, 32)
    assert lays["decoder.layers.1.mlp.router.weight"].dim is None  # replicated over TP
    one = {lay.name: lay for lay in param_layouts(args, 2, etp=1)}
    assert len(one["decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"].pieces) == 1
    # the dense layer 0 has the dense MLP
    assert (
        "decoder.layers.0.mlp.linear_fc1.weight" in full and "decoder.layers.0.mlp.router.weight" not in full
    )


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    for i, (name, (arch, dims)) in enumerate(MODELS.items()):
        save_random_hf_model(str(root / name), arch, seed=10 + i, **dims)
    return root


def test_table_names_every_hf_tensor(hf_dirs):
    from safetensors import safe_open

    for name in MODELS:
        path = hf_dirs / name
        args = model_args_from_hf_config(__import__("json").load(open(path / "config.json")))
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert hf_shapes(args) == saved, name


def _run_worker(tmp_path, jobs: list[tuple[str, str, bool]]) -> dict:
    """Megatron logits of ``jobs`` [(name, path, swap_experts)] in a fresh process (a world of one)."""
    jobs_file, out_file = str(tmp_path / "jobs.pt"), str(tmp_path / "out.pt")
    torch.save(jobs, jobs_file)
    code = f"from {__name__} import _worker; _worker({jobs_file!r}, {out_file!r})"
    dist_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_env}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH")))), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(
            f"Megatron worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return torch.load(out_file)


def _worker(jobs_file: str, out_file: str) -> None:
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.forward import run_pipeline
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.weights import tables
    from tests.distributed.workers.moe_parity import swap_experts

    ps = init_parallel(1, 1, device="cpu")
    g = torch.Generator().manual_seed(0)
    out = {}
    orig = tables.param_layouts
    for name, path, corrupt in torch.load(jobs_file):
        if corrupt:
            tables.param_layouts = lambda *a, **kw: [swap_experts(x) for x in orig(*a, **kw)]
        args = load_model_args(path)
        model = build_model(args, ps)
        load_hf_weights(model, path, ps)
        tables.param_layouts = orig
        model.eval()
        ids = torch.randint(0, args.vocab_size, (3, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding
        mb = type("MB", (), {"input_ids": ids, "attention_mask": mask})()
        with torch.no_grad():
            (logits,) = run_pipeline(
                model, ps, [mb], lambda mb, x, v=args.vocab_size: x[..., :v], forward_only=True
            )
        out[name] = {"ids": ids, "mask": mask, "logits": logits}
    torch.save(out, out_file)
    destroy_parallel()


def test_logits_match_hf_and_swapped_experts_do_not(hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    jobs = [(n, str(hf_dirs / n), False) for n in MODELS] + [
        (f"{n}/swapped", str(hf_dirs / n), True) for n in MODELS
    ]
    got = _run_worker(tmp_path, jobs)
    for name, _, corrupt in jobs:
        path = hf_dirs / name.split("/")[0]
        hf = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        r = got[name]
        with torch.no_grad():
            ref = hf(input_ids=r["ids"], attention_mask=r["mask"]).logits
        real = r["mask"].bool()
        diff = (ref - r["logits"])[real].abs().max().item()
        assert ref[real].abs().max().item() > 1.0, "weights too small to expose a layout bug"
        if corrupt:
            assert diff > 100 * TOL, f"{name}: swapping experts 0 and 1 went unnoticed ({diff:.2e})"
        else:
            assert diff < TOL, f"{name}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (
            ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=3"],
            4,
            r"expert_model_parallel_size=3.*4",
        ),
        (
            [
                "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                "critic.megatron.expert_model_parallel_size=4",
            ],
            4,
            r"critic\.megatron\.expert_model_parallel_size.*set them equal",
        ),
        (
            ["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=0"],
            4,
            r"expert_tensor_parallel_size",
        ),
    ],
)
def test_expert_layout_is_validated(overrides, world, match):
    from megatron_rl.config import ConfigError, validate
    from tests.unit.test_config import DIMS, cfg_with

    with pytest.raises(ConfigError, match=match):
        validate(cfg_with(*overrides), world_size=world, model_dims=DIMS)
    validate(cfg_with("actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"), 4, DIMS)


def test_ep_must_divide_the_experts():
    from megatron_rl.models.builder import build_model
    from megatron_rl.parallel import ParallelState

    args = model_args_from_hf_config(qwen3_moe_config())  # 8 experts
    ps = ParallelState(
        0, 3, 0, torch.device("cpu"), "gloo", 1, 1, 3, 0, 0, 0, None, None, None, None, None, ep_size=3
    )
    with pytest.raises(
        ValueError, match=r"expert_model_parallel_size=3 does not divide the model's 8 experts"
    ):
        build_model(args, ps)
