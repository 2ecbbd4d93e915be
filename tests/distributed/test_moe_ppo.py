"""One PPO update of a Qwen3-MoE actor (router aux loss and z-loss on) is invariant to the expert
layout: EP1 on one rank, EP2 on two ranks (dense parameters data-parallel, experts split), EP1 on two
ranks (experts data-parallel) and TP2 x EP2 on four, with the same rollouts; and the same with
megatron's SequentialMLP experts in place of the grouped ones (EP1, EP2, TP2 x EP2). After the update, every
copy of a parameter (router and dense weights over the EP ranks, experts over their DP ranks,
replicated weights over the TP ranks at TP2 x EP2) is bit-identical. Weights are compared as whole
HF tensors. DeepSeek-V3 (multi-latent attention, sigmoid routing, shared expert), GLM-4.5 and Qwen2-MoE
(gated shared expert, router losses on) actors take the same update at EP1 and EP2, DeepSeek-V3's
including the auxiliary-loss-free balancing's move of the expert-score bias."""

import pytest
import torch

# name -> (ranks, TP, EP, router-loss coefficient, the EP1 run it is compared with). At TP > 1 megatron
# trains MoE layers with sequence parallelism only, whose right padding to a multiple of TP adds
# tokens that the routers see: router losses and expert load then differ from TP1 by those tokens,
# so TP2 x EP2 is compared without router losses (and without the load metric).
LAYOUTS = {
    "ep1": (1, 1, 1, 0.01, None),
    "ep2": (2, 1, 2, 0.01, "ep1"),
    "dp2": (2, 1, 1, 0.01, "ep1"),
    "ep1_no_router_loss": (1, 1, 1, 0.0, None),
    "tp2ep2": (4, 2, 2, 0.0, "ep1_no_router_loss"),
    # megatron's SequentialMLP experts instead of the grouped ones, at the same layouts
    "ep1_sequential": (1, 1, 1, 0.01, "ep1"),
    "ep2_sequential": (2, 1, 2, 0.01, "ep1"),
    "tp2ep2_sequential": (4, 2, 2, 0.0, "ep1_no_router_loss"),
    "dsv3_ep1": (1, 1, 1, 0.0, None),
    "dsv3_ep2": (2, 1, 2, 0.0, "dsv3_ep1"),
    "dsv3_tp2ep2": (4, 2, 2, 0.0, "dsv3_ep1"),  # multi-latent attention's gradients at TP > 1
    "glm4_ep1": (1, 1, 1, 0.0, None),
    "glm4_ep2": (2, 1, 2, 0.0, "glm4_ep1"),
    "qwen2moe_ep1": (1, 1, 1, 0.01, None),
    "qwen2moe_ep2": (2, 1, 2, 0.01, "qwen2moe_ep1"),
}
FAMILY = {"dsv3": "deepseek_v3", "glm4": "glm4_moe", "qwen2moe": "qwen2_moe"}
"""Layouts of another family than the Qwen3-MoE actor: the prefix of their name."""
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
"""A DeepSeek-V3 MoE layer's expert-score bias (layer 0 is dense)."""
METRIC_RTOL = 1e-4
WEIGHT_TOL = 5e-5  # fp32 summation order; the update moves weights by ~1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("moe_ppo")
    qwen = save_random_hf_model(str(root / "qwen3_moe"), "qwen3_moe", seed=3, mlp_only_layers=[1])
    dsv3 = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)
    models = {
        "deepseek_v3": save_random_hf_model(
            str(root / "deepseek_v3"), "deepseek_v3", seed=4, num_hidden_layers=2, **dsv3
        ),
        "glm4_moe": save_random_hf_model(str(root / "glm4_moe"), "glm4_moe", seed=5, num_hidden_layers=2),
        "qwen2_moe": save_random_hf_model(str(root / "qwen2_moe"), "qwen2_moe", seed=6, num_hidden_layers=2),
    }
    launches: dict[int, list[list[str]]] = {}  # one per process count
    for name, (nproc, tp, ep, aux, _) in LAYOUTS.items():
        d = root / name
        d.mkdir()
        family = FAMILY.get(name.split("_")[0])
        model = models[family] if family else qwen
        flags = ["--model", model, "--tp", str(tp), "--ep", str(ep), "--aux", str(aux), "--out", str(d)]
        flags += ["--sequential-experts"] if name.endswith("_sequential") else []
        launches.setdefault(nproc, []).append(flags)
    for nproc, runs in launches.items():
        run_torchrun_runs("moe_ppo", nproc, runs)
    return {
        name: [torch.load(root / name / f"rank{r}.pt") for r in range(v[0])] for name, v in LAYOUTS.items()
    }


def merged(ranks: list[dict], key: str = "weights") -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor once, and the keys whose copies on different ranks differ at all."""
    weights, differ = {}, []
    for r in ranks:
        for name, w in r[key].items():
            if name in weights and not torch.equal(weights[name], w):
                differ.append(name)
            weights.setdefault(name, w)
    return weights, differ


@pytest.mark.parametrize(
    "layout",
    ["ep2", "dp2", "tp2ep2", "ep1_sequential", "ep2_sequential", "tp2ep2_sequential"]
    + ["dsv3_ep2", "dsv3_tp2ep2", "glm4_ep2", "qwen2moe_ep2"],
)
def test_update_is_invariant_to_the_expert_layout(runs, layout):
    (ref,) = runs[LAYOUTS[layout][4]]
    for r in runs[layout]:
        assert set(r["metrics"]) == set(ref["metrics"])
        for key, want in ref["metrics"].items():
            if key == "actor/moe_load_imbalance" and LAYOUTS[layout][1] > 1:
                continue  # counts the sequence-parallel padding tokens (see LAYOUTS)
            assert r["metrics"][key] == pytest.approx(want, rel=METRIC_RTOL, abs=1e-6), f"{key} at {layout}"
    weights, _ = merged(runs[layout], "hf")
    assert set(weights) == set(ref["hf"])
    moved = max((ref["hf"][n] - ref["initial"][n]).abs().max().item() for n in weights)
    assert moved > 20 * WEIGHT_TOL
    for name, w in weights.items():
        assert (w - ref["hf"][name]).abs().max().item() < WEIGHT_TOL, f"{name} at {layout}"


@pytest.mark.parametrize("layout", ["ep2", "dp2", "tp2ep2", "dsv3_ep2", "glm4_ep2", "qwen2moe_ep2"])
def test_copies_stay_bit_identical(runs, layout):
    ranks = runs[layout]
    _, differ = merged(ranks)
    assert differ == []
    names = [set(r["weights"]) for r in ranks]
    shared = names[0] & names[1]  # TP2 x EP2: ranks 0 and 1 are TP ranks of one model replica
    assert any("mlp.router" in n for n in shared)  # the router is replicated over EP and TP
    if layout == "tp2ep2":  # TP/EP copies: norms and router over TP, everything but experts over EP
        assert any("layernorm" in n for n in shared)
        assert {n for n in names[0] & names[2] if "local_experts" in n} == set()
    experts = {n for n in shared if "local_experts" in n}
    # EP2: each rank holds its own experts (TP2 x EP2: split over the TP pair), no whole copies
    assert bool(experts) == (layout == "dp2") or (layout == "tp2ep2" and all("@tp" in n for n in experts))


def test_the_expert_score_bias_is_trained_by_expert_load(runs):
    """Sigmoid routing's bias moves by the update rate (1e-3) against each expert's load at each of the
    update's two optimizer steps, the same at EP1 and EP2 (the load counts every DP rank's tokens);
    gradients leave it alone."""
    (ref,) = runs["dsv3_ep1"]
    moved = (ref["hf"][BIAS] - ref["initial"][BIAS]) / 1e-3  # in steps of the update rate
    assert moved.abs().max().item() > 0.5
    assert (moved - moved.round()).abs().max().item() < 1e-2  # fp32 rounding of the bias
    assert moved.abs().max().item() < 2.01
    for r in runs["dsv3_ep2"]:
        assert torch.equal(r["hf"][BIAS], ref["hf"][BIAS])


def test_router_metrics(runs):
    m = runs["ep1"][0]["metrics"]
    # max/mean tokens per expert: 1 if balanced, at most E/top_k = 2 (every token on the same 2 of 4)
    assert 1.0 <= m["actor/moe_load_imbalance"] <= 2.0
    assert m["actor/moe_aux_loss"] > 0 and m["actor/moe_z_loss"] > 0
