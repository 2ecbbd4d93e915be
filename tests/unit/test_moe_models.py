"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4.5, DeepSeek-V3) from HF
directories, in one process (TP1/EP1).

Logits parity with the HF model at O(1) random weights (each token's routing then depends on its
hidden state and a wrong expert order changes the logits by O(1)); the negative controls read two
experts' weights into each other's place, or zero the expert-score bias of sigmoid routing, and must
fail. The config mapping (which layers are MoE, the routing variant, multi-latent attention) and the
expert-parallel split of the weight table are checked by hand. gpt-oss is refused in one line.
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
    "qwen2_moe": ("qwen2_moe", dict(mlp_only_layers=[2])),  # shared expert + gate, softmax top-k as is
    "glm4_moe": ("glm4_moe", {}),  # sigmoid + bias, shared expert, dense layer 0, partial RoPE, biases
    "deepseek_v3": ("deepseek_v3", {}),  # MLA with q LoRA, YaRN + mscale, grouped top-k, scaling
    # q without its low-rank bottleneck, plain RoPE, one group, and a multi-token-prediction layer in
    # the files (loaded and ignored, as the HF model does)
    "deepseek_v3_q_proj": (
        "deepseek_v3",
        dict(q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1, num_nextn_predict_layers=1),
    ),
}
SIGMOID = ("glm4_moe", "deepseek_v3", "deepseek_v3_q_proj")
"""Models with the expert-score bias (its negative control zeroes it)."""


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


def test_gpt_oss_is_refused_in_one_line():
    cfg = {**qwen3_moe_config(), "architectures": ["GptOssForCausalLM"]}
    with pytest.raises(ValueError) as e:
        model_args_from_hf_config(cfg, source="/models/gpt-oss-20b")
    msg = str(e.value)
    assert "\n" not in msg and "GptOssForCausalLM" in msg and "attention sinks" in msg


def deepseek_v3_config(**overrides) -> dict:
    """DeepSeek-V3's own config.json fields (its real widths), layer count cut to 5."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 5,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }
    cfg.update(overrides)
    return cfg


def test_deepseek_v3_glm4_moe_and_qwen2_moe_configs_are_read():
    a = model_args_from_hf_config(deepseek_v3_config())
    assert a.arch == "deepseek_v3" and a.mla is not None and a.mla.q_lora_rank == 1536
    assert (a.mla.kv_lora_rank, a.mla.qk_nope_head_dim, a.mla.qk_rope_head_dim, a.mla.v_head_dim) == (
        512,
        128,
        64,
        128,
    )
    assert a.yarn is not None and a.yarn.factor == 40 and a.yarn.mscale_all_dim == 1.0
    assert a.moe_layers == (False, False, False, True, True)
    assert (a.moe_score_function, a.moe_expert_bias, a.moe_num_groups, a.moe_group_topk) == (
        "sigmoid",
        True,
        8,
        4,
    )
    assert a.moe_routed_scaling == 2.5 and a.moe_shared_ffn_hidden_size == 2048 and a.num_experts == 256
    # one DeepSeek-V3 MoE layer: 187.1M attention weights, 256 routed + 1 shared experts of 44M
    assert a.attention_params() == 187_105_280
    assert a.attention_head_dim == (128 + 64 + 128) / 2  # scores over nope + rope dims, values over v
    # DeepSeek-V3 whole: ~671B parameters (without its MTP layer), ~37B active
    full = model_args_from_hf_config(deepseek_v3_config(num_hidden_layers=61))
    assert 670e9 < full.num_params() < 672e9 and 37e9 < full.num_active_params() < 38e9
    glm = model_args_from_hf_config(
        {
            **qwen3_moe_config(),
            "architectures": ["Glm4MoeForCausalLM"],
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": False,
        }
    )
    assert glm.arch == "glm4_moe" and glm.rotary_percent == 0.5 and glm.qkv_bias and not glm.qk_norm
    assert glm.moe_layers[0] is False and all(glm.moe_layers[1:]) and glm.moe_expert_bias
    assert glm.mla is None and glm.moe_num_groups == 0
    q2 = model_args_from_hf_config(
        {
            **qwen3_moe_config(),
            "architectures": ["Qwen2MoeForCausalLM"],
            "shared_expert_intermediate_size": 48,
        }
    )
    assert q2.qkv_bias and q2.moe_shared_ffn_hidden_size == 48 and q2.moe_shared_expert_gate
    assert q2.moe_score_function == "softmax" and not q2.moe_expert_bias
    # transformers 5 writes sliding_window=0 beside use_sliding_window=false: full attention
    off = {"sliding_window": 0, "use_sliding_window": False}
    q2 = model_args_from_hf_config(
        {
            **qwen3_moe_config(),
            "architectures": ["Qwen2MoeForCausalLM"],
            "shared_expert_intermediate_size": 48,
            **off,
        }
    )
    assert q2.sliding_window is None


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"n_group": 8, "topk_group": 2}, "n_group=8, topk_group=2"),
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ],
)
def test_deepseek_v3_variants_megatron_cannot_express_are_refused_in_one_line(overrides, match):
    with pytest.raises(ValueError, match=match) as e:
        model_args_from_hf_config(deepseek_v3_config(**overrides), source="/models/dsv3")
    assert "\n" not in str(e.value) and "/models/dsv3" in str(e.value)


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
    add_mtp_layer(root / "deepseek_v3_q_proj")
    return root


def add_mtp_layer(path) -> None:
    """Write a multi-token-prediction layer into the files as DeepSeek-V3's checkpoints hold it: layer
    ``num_hidden_layers`` with its own projections and norms (no model class builds it)."""
    from safetensors.torch import load_file, save_file

    file = str(path / "model.safetensors")
    tensors = load_file(file)
    n = 4  # TINY's num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    tensors[f"model.layers.{n}.hnorm.weight"] = torch.ones(64)
    tensors[f"model.layers.{n}.self_attn.q_proj.weight"] = torch.randn(96, 64)
    save_file(tensors, file, metadata={"format": "pt"})


def test_table_names_every_hf_tensor(hf_dirs):
    from safetensors import safe_open

    for name in MODELS:
        path = hf_dirs / name
        args = model_args_from_hf_config(__import__("json").load(open(path / "config.json")))
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        mtp = {k for k in saved if k.startswith(f"model.layers.{args.num_layers}.")}
        assert bool(mtp) == (name == "deepseek_v3_q_proj"), name
        assert hf_shapes(args) == {k: v for k, v in saved.items() if k not in mtp}, name


def _run_worker(tmp_path, jobs: list[tuple[str, str, str | None]]) -> dict:
    """Megatron logits of ``jobs`` [(name, path, corruption)] in a fresh process (a world of one);
    corruption: None, "swap" (experts 0 and 1 of every layer) or "zero_bias" (the expert-score bias)."""
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
        if corrupt == "swap":
            tables.param_layouts = lambda *a, **kw: [swap_experts(x) for x in orig(*a, **kw)]
        args = load_model_args(path)
        model = build_model(args, ps)
        load_hf_weights(model, path, ps)
        tables.param_layouts = orig
        if corrupt == "zero_bias":
            for n, b in model.named_buffers():
                if n.endswith("router.expert_bias"):
                    b.zero_()
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

    jobs = (
        [(n, str(hf_dirs / n), None) for n in MODELS]
        + [(f"{n}/swapped", str(hf_dirs / n), "swap") for n in MODELS]
        + [(f"{n}/zero_bias", str(hf_dirs / n), "zero_bias") for n in SIGMOID]
    )
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
            assert diff > 100 * TOL, f"{name}: {corrupt} went unnoticed ({diff:.2e})"
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
