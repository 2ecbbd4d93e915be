"""Interleaved pipelines (*.megatron.virtual_pipeline_model_parallel_size: megatron-core model chunks
and its interleaved 1F1B schedule) on gloo, against independent oracles:

- logits of a dense model (Llama), a Qwen3-MoE (a dense layer among the sparse ones) and a
  DeepSeek-V3 (multi-latent attention, its first layer dense) at PP2 x VPP2,
  PP2 x VPP2 with megatron's uneven first stage, PP2 x VPP4 and TP2 x PP2 x VPP2 (sequence
  parallelism) equal the HF model's (PP=1); a layer
  read twice (its own never) must fail; an odd number of micro-batches (filled up by run_pipeline)
  gives the same outputs;
- the weight stream to the engine gives the HF files bit for bit at PP2 x VPP2 (uneven too, and at
  TP2);
- torch_dist checkpoints across (PP, VPP) layouts: saved at PP2 x VPP2, loaded at PP2 x VPP2 uneven
  at PP2 (no chunks) and at TP2 x PP2 x VPP2; saved uneven, loaded at PP2 x VPP4: every parameter
  bit-exact; the
  checkpoint saved at PP2 x VPP2 converts to the HF files bit for bit (ckpt_tools mcore-to-hf);
- a full PPO update (actor and critic, 4 optimizer steps each; a tied dense actor and a Qwen3-MoE
  one) at PP2 x VPP2 (plain optimizer; and with token-budget micro-batches and the distributed
  optimizer, padded or packed) equals the unsharded PP=1 run: forward passes, loss and grad-norm
  metrics, updated weights, within the tolerances of test_ppo_layouts.py (fp32);
- the trainer's checkpoint (weights + the distributed optimizer's sharded state) of PP2 x VPP2 model
  chunks resumes bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import read_json

ARCHS = ["llama", "qwen3_moe", "deepseek_v3"]
ONLY = {"tp2_pp2_vpp2": ["qwen3_moe"]}  # 4 processes on few cores: the MoE model (sequence parallel)


def archs(layout: str) -> list[str]:
    return ONLY.get(layout, ARCHS)


TOL = 1e-4
# id: (vpp, first, load from, save, extra flags)
LAYOUTS = {
    "pp2_vpp2": (2, None, None, "vpp2", ["--stream"]),
    "pp2_vpp2_first2": (2, 2, "vpp2", "first2", ["--stream"]),
    "pp2": (1, None, "vpp2", None, []),
    "pp2_vpp4": (4, None, "first2", None, []),
    "pp2_vpp2_duplicated": (2, None, None, None, ["--corrupt", "duplicate"]),
    # 4 processes: TP2 (sequence parallelism) x PP2 x VPP2
    "tp2_pp2_vpp2": (2, None, "vpp2", None, ["--tp", "2", "--stream"]),
}
# decoder layers of each virtual stage (chunk v of rank p: v * 2 + p) and each rank's chunk offsets
SPLITS = {
    "pp2_vpp2": ([2, 2, 2, 2], [[0, 4], [2, 6]]),
    "pp2_vpp2_first2": ([1, 3, 1, 3], [[0, 4], [1, 5]]),
    "pp2": ([4, 4], [[0], [4]]),
    "pp2_vpp4": ([1] * 8, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    "tp2_pp2_vpp2": ([2, 2, 2, 2], [[0, 4], [2, 6]]),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    from tests.distributed.test_uneven_pp import save_models

    return save_models(tmp_path_factory.mktemp("hf_vpp"), 8)


@pytest.fixture(scope="module")
def results(hf_models, tmp_path_factory) -> tuple[dict[str, dict], str]:
    """({layout id: the worker's result}, the checkpoint directory): one launch of 2 processes, then
    one of 4."""
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("vpp")
    launches: dict[int, list[list[str]]] = {}
    for name, (vpp, first, load, save, flags) in LAYOUTS.items():
        argv = ["--models", hf_models, "--archs", *archs(name), "--pp", "2", "--vpp", str(vpp)]
        argv += ["--first", str(first)] if first else []
        argv += ["--load", str(root / load)] if load else []
        argv += ["--save", str(root / save)] if save else []
        nproc = 4 if "--tp" in flags else 2
        launches.setdefault(nproc, []).append([*argv, *flags, "--out", str(root / f"{name}.json")])
    for nproc, runs in sorted(launches.items()):
        run_torchrun_runs("vpp", nproc, runs)
    return {name: read_json(str(root / f"{name}.json")) for name in LAYOUTS}, str(root)


@pytest.mark.parametrize("layout", list(SPLITS))
def test_interleaved_stages_match_hf(results, layout):
    res, _ = results
    split, offsets = SPLITS[layout]
    for arch in archs(layout):
        r = res[layout][arch]
        assert r["stage_layers"] == split and r["chunk_offsets"] == offsets, arch
        assert r["max_logit"] > 1.0, "weights too small to expose a layout bug"
        assert r["max_diff"] < TOL, f"{arch} at {layout}: max |logit diff| {r['max_diff']:.2e}"
        assert r["filler_ok"], f"{arch} at {layout}: a filled-up micro-batch group changed the outputs"


def test_a_duplicated_layer_is_seen(results):
    res, _ = results
    for arch in ARCHS:
        assert res["pp2_vpp2_duplicated"][arch]["max_diff"] > 100 * TOL, arch


@pytest.mark.parametrize("layout", ["pp2_vpp2", "pp2_vpp2_first2", "tp2_pp2_vpp2"])
def test_the_weight_stream_gives_the_hf_files(results, layout):
    res, _ = results
    for arch in archs(layout):
        assert res[layout][arch]["stream_exact"] is True, arch


@pytest.mark.parametrize("layout", ["pp2_vpp2_first2", "pp2", "pp2_vpp4", "tp2_pp2_vpp2"])
def test_checkpoints_load_across_layouts_bit_exact(results, layout):
    res, _ = results
    for arch in archs(layout):
        assert res[layout][arch]["load_exact"] is True, f"{arch}: loaded at {layout}"


def test_an_interleaved_checkpoint_converts_to_hf_bit_exact(results, hf_models, tmp_path):
    from tests.distributed.test_uneven_pp import assert_converts_to_hf

    _, root = results
    for arch in ARCHS:
        ckpt = os.path.join(root, "vpp2", arch)
        assert_converts_to_hf(ckpt, os.path.join(hf_models, arch), str(tmp_path / arch))


# ---- one PPO update at PP2 x VPP2 against the unsharded run ----------------------------------------

PPO = {  # name: (nproc, worker arguments)
    "pp1": (1, ["--micro", "8"]),
    "pp2_vpp2": (2, ["--pp", "2", "--vpp", "2", "--micro", "2", "--no-distributed-optimizer"]),
    "dyn_pp2_vpp2": (2, ["--pp", "2", "--vpp", "2", "--micro", "2", "--max-tokens", "24"]),
    # packed sequences (use_remove_padding) with token-budget micro-batches on model chunks
    "thd_pp2_vpp2": (2, ["--pp", "2", "--vpp", "2", "--micro", "2", "--max-tokens", "24", "--packed"]),
    # LoRA adapters (actor and critic) on the model chunks against LoRA at PP=1; the PP=1 run's actor
    # checkpoint (its adapters) loaded into model chunks
    "lora_pp1": (1, ["--micro", "8", "--lora", "--save-actor"]),
    "lora_pp2_vpp2": (
        2,
        ["--pp", "2", "--vpp", "2", "--micro", "2", "--lora", "--save-actor"]
        + ["--load-actor", "{root}/lora_pp1"],
    ),
}


PAIRS = ("dense", "moe")


@pytest.fixture(scope="module")
def ppo(tmp_path_factory) -> dict:
    """{run: {pair: its result and weights}}, {"initial": {pair: the HF weights}}, {"models": the
    dense pair's directories}: a tied Qwen2 actor and a Qwen3-MoE actor (its second layer dense), each
    with a Llama critic, of 4 layers (one per virtual stage)."""
    from megatron_rl.models.random_hf import save_random_hf_model
    from tests.conftest import run_torchrun_runs
    from tests.distributed.test_ppo_layouts import _load_hf, read_pair

    root = tmp_path_factory.mktemp("vpp_ppo")
    actor = save_random_hf_model(
        str(root / "actor"), "qwen2", seed=3, num_hidden_layers=4, tie_word_embeddings=True
    )
    critic = save_random_hf_model(str(root / "critic"), "llama", seed=13, num_hidden_layers=4)
    moe = save_random_hf_model(
        str(root / "moe"), "qwen3_moe", seed=5, num_hidden_layers=4, mlp_only_layers=[1]
    )
    pairs = {"dense": (actor, critic), "moe": (moe, critic)}
    launches: dict[int, list[list[str]]] = {}
    for name, (nproc, argv) in PPO.items():
        (root / name).mkdir()
        launches.setdefault(nproc, []).append(
            ["--models", *(f"{p}={a},{c}" for p, (a, c) in pairs.items())]
            + [x.format(root=root) for x in argv]
            + ["--device", "cpu"]
            + ["--out", str(root / name)]
        )
    for nproc, runs in sorted(launches.items()):  # 1 process first: lora_pp2_vpp2 loads its checkpoint
        run_torchrun_runs("ppo_update", nproc, runs)
    out = {name: {p: read_pair(root / name / p) for p in pairs} for name in PPO}
    out["initial"] = {p: {"actor": _load_hf(a), "critic": _load_hf(c)} for p, (a, c) in pairs.items()}
    out["models"] = (actor, critic)
    out["root"] = str(root)
    return out


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("layout", ["pp2_vpp2", "dyn_pp2_vpp2", "thd_pp2_vpp2", "lora_pp2_vpp2"])
def test_a_ppo_update_at_pp2_vpp2_matches_pp1(ppo, layout, pair):
    """The update at PP2 x VPP2 equals PP=1's; with LoRA, LoRA's at PP=1 (the merged weights W + s B A,
    adapters on every model chunk; a MoE actor's routed experts too)."""
    from tests.distributed.test_ppo_layouts import (
        LAYOUT_TOL,
        WEIGHT_ELEM_TOL,
        WEIGHT_REL_NORM_TOL,
        assert_metrics_match,
    )

    base = "lora_pp1" if layout.startswith("lora_") else "pp1"
    ref, r = ppo[base][pair]["result"], ppo[layout][pair]["result"]
    for key in ("logp", "entropy", "values"):
        diff = (torch.tensor(r[key]) - torch.tensor(ref[key])).abs().max().item()
        assert diff < LAYOUT_TOL, f"{key} at {layout}: max diff {diff:.2e}"
    if layout.startswith(("dyn_", "thd_")):  # the experts' load counts padding, which these drop
        r = {**r, "actor": {k: v for k, v in r["actor"].items() if k != "actor/moe_load_imbalance"}}
        ref = {**ref, "actor": {k: v for k, v in ref["actor"].items() if k != "actor/moe_load_imbalance"}}
    assert_metrics_match(ref, r, layout)  # losses, clip fractions, KL, grad norms
    assert r["actor_steps"] == 4
    for role in ("actor", "critic"):
        (want,) = [w[role] for w in ppo[base][pair]["weights"].values()]
        initial = ppo["initial"][pair][role]
        moved = max((want[n] - initial[n]).abs().max().item() for n in want if n in initial)
        assert moved > 5 * WEIGHT_ELEM_TOL, f"the update barely moved the {role}"
        if base == "lora_pp1":  # the base frozen, the adapted linears moved
            assert torch.equal(want["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
            q = "model.layers.0.self_attn.q_proj.weight"
            assert (want[q] - initial[q]).abs().max().item() > 5 * WEIGHT_ELEM_TOL
        seen = set()
        for stage in ppo[layout][pair]["weights"].values():
            for name, w in stage[role].items():
                update = want[name] - initial[name] if name in initial else want[name]
                if update.norm() > 0:  # LoRA: the frozen base's other weights stay where they were
                    assert ((w - want[name]).norm() / update.norm()).item() < WEIGHT_REL_NORM_TOL, name
                assert (w - want[name]).abs().max().item() < WEIGHT_ELEM_TOL, name
                seen.add(name)
        assert seen == set(want), f"{role}: missing {sorted(set(want) - seen)}"


@pytest.mark.parametrize("pair", PAIRS)
def test_a_lora_checkpoint_of_pp1_loads_into_model_chunks_bit_exact(ppo, pair):
    """The LoRA actor's checkpoint saved at PP=1 (adapters only) loaded at PP2 x VPP2 over the base:
    every merged weight of every stage equals the PP=1 actor's bit for bit."""
    (want,) = [w["actor"] for w in ppo["lora_pp1"][pair]["weights"].values()]
    seen = set()
    for stage in ppo["lora_pp2_vpp2"][pair]["weights"].values():
        for name, w in stage["loaded"].items():
            assert torch.equal(w, want[name]), name
            seen.add(name)
    assert seen == set(want)


def test_a_lora_checkpoint_of_model_chunks_exports_to_peft(ppo, tmp_path):
    """ckpt_tools export-peft --merged of the dense LoRA actor saved at PP2 x VPP2 (adapters only, global
    layer names): the HF model it writes holds the weights that run's model chunks held."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    ckpt = os.path.join(ppo["root"], "lora_pp2_vpp2", "dense", "actor_ckpt")
    out = str(tmp_path / "merged")
    cmd = [sys.executable, "-m", "ckpt_tools", "export-peft", "--ckpt", ckpt, "--out", out, "--merged"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = load_file(os.path.join(out, "model.safetensors"))
    stages = [w["actor"] for w in ppo["lora_pp2_vpp2"]["dense"]["weights"].values()]
    want = {n: t for stage in stages for n, t in stage.items()}
    assert set(want) <= set(got)
    for name, t in want.items():
        assert (got[name].float() - t).abs().max().item() < 1e-5, name


def test_token_budget_micro_batches_come_in_multiples_of_pp(ppo):
    """Interleaving runs groups of PP micro-batches: the dynamic plan splits to a multiple of 2."""
    plans = ppo["dyn_pp2_vpp2"]["dense"]["plans"]
    assert plans
    for plan in plans.values():
        for counts in plan["micro_batch_tokens"]:
            assert len(counts) % 2 == 0 and max(counts) <= 24, counts


def test_interleaved_chunks_resume_bit_exact_from_the_trainers_checkpoint(ppo, tmp_path):
    """Weights and the distributed optimizer's sharded state of a PP2 x VPP2 tied actor, saved after 2
    steps: 2 more steps from the save equal 2 more without it, bit for bit; with the weights alone
    (Adam restarted) they do not (the negative control)."""
    from tests.conftest import run_torchrun

    actor, _ = ppo["models"]
    out = str(tmp_path / "resume.json")
    run_torchrun("vpp_resume.py", 2, ["--model", actor, "--ckpt", str(tmp_path / "ckpt"), "--out", out])
    r = read_json(out)
    assert r["moved"] and r["resumed_equal"] and not r["weights_only_equal"], r
