"""One full PPO update (actor and critic) gives the same result at TP1, TP2, PP2, TP2xPP2 and DP2
(torchrun/gloo), for every supported architecture as actor and as critic.

Oracle: the unsharded TP1/PP1/DP1 run with one micro-batch per mini-batch (no gradient accumulation),
whose losses are plain mini-batch means. The other layouts split every mini-batch into micro-batches of
2 sequences with different token counts (responses of 1..5 tokens), so a wrong loss denominator, a
missing DP/TP/PP reduction or a tied-embedding copy that is not kept in sync changes the result.
Training runs megatron-core's DDP and optimizer: TP2 with sequence parallelism, TP2xPP2 without it,
DP2 (and every layout but PP2) with the distributed optimizer, PP2 with the plain one. After the
updates every TP-replicated parameter (norms, Qwen3's q/k norms, value heads) must be bit-identical on
the TP ranks; the negative control drops the TP sum of Qwen3's q/k-norm gradients and must break that.
The dyn_* layouts (two of the pairs) run every pass with token-budget micro-batches (use_dynamic_bsz:
length-sorted groups of at most MAX_TOKENS tokens, each row compacted to its real tokens, so positions
shift, shapes change between micro-batches and pipeline stages exchange shapes) and must match the same
unsharded fixed-size oracle; the actor and critic losses are seq-mean-token-sum-norm, whose constant
must not become a micro-batch's own width; their plans must respect the budget, with equal micro-batch
counts on every rank of a pass. The thd_* layouts run every pass packed (use_remove_padding: each
micro-batch one row of its real tokens, attention and RoPE per sequence, models/packing.py), with
fixed-size and token-budget micro-batches, TP2 with sequence parallelism, PP2 and TP2xPP2, and must match
the same padded oracle (thd_tp1 the HF model too); their budgets count real tokens, so their padding is
the TP rounding only. The same checks run over NCCL on 2 GPUs in tests/gpu/test_ppo_gpu.py.

Tolerances (fp32; O(1) random weights, |log-probs| up to ~30 at temperature 2):
- log-probs and entropies vs the HF model: 1e-4 absolute (observed <= 1e-5);
- log-probs, entropies and values between layouts: 5e-5 absolute (observed <= 8e-6);
- loss, clip-fraction, KL, entropy, value and grad-norm metrics: 1e-4 relative or 1e-5 absolute
  (observed <= 4e-5 relative, on ppo_kl, a mean of signed terms);
- updated weights, per HF tensor: ||w - w_TP1|| <= 3e-3 ||w_TP1 - w_initial|| (observed <= 7e-4) and
  every element within 5e-4. Adam normalises each element's step by its own gradient scale, so an
  element whose gradient is at cancellation level moves by a fraction of the LR that fp32 rounding
  changes: the worker uses Adam eps 1e-6 (not 1e-8) so that such elements (an embedding row whose
  only uses sit in clipped value-loss terms has gradients ~1e-7) take small steps; the 4 steps move
  weights by up to 6e-3 (checked, so the comparison is not vacuous).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.conftest import read_json

HF_ORACLE = ("tp1", "tp2", "thd_tp1")  # the other layouts' log-probs are compared with TP1's
LAYOUTS = {  # name: (tp, pp, nproc, micro-batch size, extra worker arguments)
    "tp1": (1, 1, 1, 8, []),
    "tp2": (2, 1, 2, 2, []),
    "pp2": (1, 2, 2, 2, ["--no-distributed-optimizer"]),
    "tp2pp2": (2, 2, 4, 2, ["--no-sequence-parallel"]),
    "dp2": (1, 1, 2, 2, []),
    "dyn_tp1": (1, 1, 1, 8, ["--max-tokens", "24"]),
    "dyn_tp2": (2, 1, 2, 2, ["--max-tokens", "24"]),
    "dyn_pp2": (1, 2, 2, 2, ["--no-distributed-optimizer", "--max-tokens", "24"]),
    "dyn_dp2": (1, 1, 2, 2, ["--max-tokens", "24"]),
    "thd_tp1": (1, 1, 1, 4, ["--packed"]),
    "thd_tp2": (2, 1, 2, 2, ["--packed", "--max-tokens", "24"]),
    "thd_pp2": (1, 2, 2, 2, ["--packed", "--no-distributed-optimizer", "--max-tokens", "24"]),
    "thd_tp2pp2": (2, 2, 4, 2, ["--packed", "--no-sequence-parallel"]),
}
MAX_TOKENS = 24
DYNAMIC = [name for name in LAYOUTS if "--max-tokens" in LAYOUTS[name][4]]
PACKED = [name for name in LAYOUTS if name.startswith("thd_")]
REDUCED = set(DYNAMIC + PACKED)  # layouts that run DYNAMIC_PAIRS only
SHARDED = [name for name in LAYOUTS if name != "tp1"]
# Each architecture once as actor (LM head; tied where it has the option) and once as critic.
PAIRS = {  # name: ((actor arch, tie embeddings), critic arch)
    "qwen2": (("qwen2", True), "llama"),
    "llama": (("llama", True), "qwen3"),
    "qwen3": (("qwen3", False), "mistral"),
    "mistral": (("mistral", False), "phi3"),
    "phi3": (("phi3", False), "qwen2"),
}
DYNAMIC_PAIRS = ("qwen2", "qwen3")  # the dyn_* and thd_* layouts: a tied actor, and q/k norms
LOGP_HF_TOL = 1e-4


def _cases(layouts: list[str]) -> list[tuple[str, str]]:
    """(layout, pair) of every pair the layout runs."""
    return [(lay, p) for lay in layouts for p in (DYNAMIC_PAIRS if lay in REDUCED else PAIRS)]


LAYOUT_TOL = 5e-5
METRIC_RTOL, METRIC_ATOL = 1e-4, 1e-5
WEIGHT_REL_NORM_TOL = 3e-3
WEIGHT_ELEM_TOL = 5e-4


def save_models(root) -> dict[str, tuple[str, str]]:
    """Every pair's HF directories: 2 layers, an odd vocabulary (99 -> padded to 100 at TP2); a tied
    head lives on both stages at PP2."""
    from megatron_rl.models.random_hf import save_random_hf_model

    pairs = {}
    for i, (name, ((actor_arch, tie), critic_arch)) in enumerate(PAIRS.items()):
        actor = save_random_hf_model(
            str(root / f"{name}-actor"), actor_arch, seed=3 + i, num_hidden_layers=2, tie_word_embeddings=tie
        )
        critic = save_random_hf_model(
            str(root / f"{name}-critic"), critic_arch, seed=13 + i, num_hidden_layers=2
        )
        pairs[name] = (actor, critic)
    return pairs


def _layout_args(root, name: str, pairs: dict[str, tuple[str, str]], extra_args: list[str]) -> list[str]:
    """The worker's arguments for LAYOUTS[name] over every pair it runs; its output goes to root/name."""
    tp, pp, nproc, micro, layout_args = LAYOUTS[name]
    if name in REDUCED:
        pairs = {p: pairs[p] for p in DYNAMIC_PAIRS}
    d = root / name
    d.mkdir()
    args = ["--models", *(f"{p}={a},{c}" for p, (a, c) in pairs.items())]
    args += ["--tp", str(tp), "--pp", str(pp), "--micro", str(micro), "--out", str(d)]
    return args + [*layout_args, *extra_args] + (["--hf-oracle"] if name in HF_ORACLE else [])


def run_layouts(
    root, names: list[str], pairs: dict[str, tuple[str, str]], extra_args: list[str], more=()
) -> dict:
    """One torchrun launch running the worker for each of ``names`` (layouts of one process count), one
    after another, then for each argument list of ``more``: {layout: {pair: result and weights}}.
    Sharing the launch saves a process start and a torch.distributed world per layout; each run still
    builds its parallel groups and models afresh."""
    from tests.conftest import run_torchrun_runs

    assert len({LAYOUTS[n][2] for n in names}) == 1, names
    runs = [_layout_args(root, name, pairs, extra_args) for name in names] + list(more)
    run_torchrun_runs("ppo_update", LAYOUTS[names[0]][2], runs)
    out = {}
    for name in names:
        ran = DYNAMIC_PAIRS if name in REDUCED else pairs
        out[name] = {pair: read_pair(root / name / pair) for pair in ran}
    return out


def run_layout(root, name: str, pairs: dict[str, tuple[str, str]], extra_args: list[str]) -> dict:
    """One torchrun launch of the worker for LAYOUTS[name] over every pair: {pair: result and weights}."""
    return run_layouts(root, [name], pairs, extra_args)[name]


def read_pair(d) -> dict:
    weights = {
        os.path.basename(f)[len("weights_") : -3]: torch.load(f) for f in glob.glob(str(d / "weights_*.pt"))
    }
    plans = {os.path.basename(f)[5:-5]: read_json(f) for f in glob.glob(str(d / "plan_*.json"))}
    return {"result": read_json(str(d / "result.json")), "weights": weights, "plans": plans}


def run_all_layouts(root, extra_args: list[str], max_procs: int = 4, qk_norm_control: bool = False) -> dict:
    """{layout: {pair: run}} for the layouts of at most ``max_procs`` processes (one launch per process
    count: tp2, pp2, dp2 and their dyn_* runs share one), {"initial": {pair: {"actor": weights,
    "critic": weights}}} and {"models": {pair: (actor dir, critic dir)}}. ``qk_norm_control``: the
    2-process launch also runs the qwen3 pair at TP2 without the TP sum of its q/k-norm gradients,
    {"broken": run}."""
    pairs = save_models(root)
    launches: dict[int, list[str]] = {}
    for name, v in LAYOUTS.items():
        if v[2] <= max_procs:
            launches.setdefault(v[2], []).append(name)
    actor, critic = pairs["qwen3"]
    broken = ["--models", f"qwen3={actor},{critic}", "--tp", "2", "--micro", "2", *extra_args]
    broken += ["--out", str(root / "broken"), "--break-qk-norm-reduction"]
    out = {}
    for nproc, names in launches.items():
        more = [broken] if qk_norm_control and nproc == 2 else []
        out.update(run_layouts(root, names, pairs, extra_args, more))
    if qk_norm_control:
        out["broken"] = read_pair(root / "broken" / "qwen3")
    out["initial"] = {p: {"actor": _load_hf(a), "critic": _load_hf(c)} for p, (a, c) in pairs.items()}
    out["models"] = pairs
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_all_layouts(tmp_path_factory.mktemp("ppo"), ["--device", "cpu"], qk_norm_control=True)


def _load_hf(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("layout,pair", _cases(list(HF_ORACLE)))
def test_log_probs_match_hf(runs, layout, pair):
    r = runs[layout][pair]["result"]
    assert r["max_abs_logp"] > 5.0, "weights too small to expose a layout bug"
    assert r["hf_logp_max_diff"] < LOGP_HF_TOL, r["hf_logp_max_diff"]
    assert r["hf_entropy_max_diff"] < LOGP_HF_TOL, r["hf_entropy_max_diff"]
    # Negative control: logits taken one position late (the classic off-by-one) are far off.
    assert r["hf_misaligned_diff"] > 100 * LOGP_HF_TOL
    assert r["logp_only_vs_with_entropy"] < LAYOUT_TOL  # with_entropy=False, other micro-batches


@pytest.mark.parametrize("layout,pair", _cases(SHARDED))
def test_forward_passes_match_tp1(runs, layout, pair):
    ref, r = runs["tp1"][pair]["result"], _layout(runs, layout)[pair]["result"]
    for key in ("logp", "entropy", "values"):
        diff = (torch.tensor(r[key]) - torch.tensor(ref[key])).abs().max().item()
        assert diff < LAYOUT_TOL, f"{key} at {layout}: max diff {diff:.2e}"


def assert_metrics_match(ref: dict, r: dict, where: str) -> None:
    for role in ("actor", "critic"):
        assert set(r[role]) == set(ref[role])
        for key, want in ref[role].items():
            assert r[role][key] == pytest.approx(want, rel=METRIC_RTOL, abs=METRIC_ATOL), f"{key} at {where}"


@pytest.mark.parametrize("layout,pair", _cases(SHARDED))
def test_update_metrics_match_tp1(runs, layout, pair):
    r = _layout(runs, layout)[pair]["result"]
    assert_metrics_match(runs["tp1"][pair]["result"], r, f"{layout} ({pair})")
    assert r["actor_steps"] == 4


def test_update_exercises_every_loss_term(runs):
    a, c = runs["tp1"]["qwen2"]["result"]["actor"], runs["tp1"]["qwen2"]["result"]["critic"]
    expected = {
        "actor/loss",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/entropy_loss",  # verl's second name for actor/entropy
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/lr",
        "actor/nonfinite_grad_steps",
    }
    assert set(a) == expected
    assert set(c) == {
        "critic/vf_loss",
        "critic/loss",  # verl's second name for critic/vf_loss
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/nonfinite_grad_steps",
    }
    # clipping, dual-clip and value clipping are all active somewhere in the batch
    assert a["actor/pg_clipfrac"] > 0 and a["actor/pg_clipfrac_lower"] > 0 and c["critic/vf_clipfrac"] > 0
    assert a["actor/kl_loss"] > 0 and a["actor/entropy"] > 0
    # warmup 1 step, then cosine from 2e-3 to min_lr 2e-4 at step 4: 2e-3, 2e-3, 1.55e-3, 6.5e-4
    assert a["actor/lr"] == pytest.approx((2e-3 + 2e-3 + 1.55e-3 + 6.5e-4) / 4)
    # linear 2e-3 -> 0 over 4 steps: 2e-3, 1.5e-3, 1e-3, 5e-4
    assert c["critic/lr"] == pytest.approx((2e-3 + 1.5e-3 + 1e-3 + 5e-4) / 4)


def _layout(runs: dict, layout: str) -> dict:
    if layout not in runs:
        pytest.skip(f"{layout} needs more processes than this machine runs")
    return runs[layout]


def _stages(run: dict, role: str, dp: int = 0) -> list[dict[str, torch.Tensor]]:
    return [w[role] for k, w in sorted(run["weights"].items()) if k.endswith(f"_dp{dp}")]


@pytest.mark.parametrize("layout,pair", _cases(SHARDED))
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_updated_weights_match_tp1(runs, layout, role, pair):
    (ref,) = _stages(runs["tp1"][pair], role)
    initial = runs["initial"][pair][role]
    moved = max((ref[n] - initial[n]).abs().max().item() for n in ref if n in initial)
    assert moved > 5 * WEIGHT_ELEM_TOL, f"the update barely moved the {role}: {moved:.2e}"
    seen = set()
    for stage in _stages(_layout(runs, layout)[pair], role):
        for name, w in stage.items():
            update = ref[name] - initial[name] if name in initial else ref[name]  # value head: not in HF
            rel = ((w - ref[name]).norm() / update.norm()).item()
            elem = (w - ref[name]).abs().max().item()
            assert rel < WEIGHT_REL_NORM_TOL, f"{role} {name} at {layout}: |diff| / |update| = {rel:.2e}"
            assert elem < WEIGHT_ELEM_TOL, f"{role} {name} at {layout}: max diff {elem:.2e}"
            seen.add(name)
    assert seen == set(ref), f"missing at {layout}: {sorted(set(ref) - seen)}"


@pytest.mark.parametrize("pair", list(PAIRS))
def test_data_parallel_replicas_are_identical(runs, pair):
    for role in ("actor", "critic"):
        (a,), (b,) = _stages(runs["dp2"][pair], role, 0), _stages(runs["dp2"][pair], role, 1)
        for name in a:
            assert torch.equal(a[name], b[name]), f"{role} {name} differs between DP replicas"


@pytest.mark.parametrize("layout", ["pp2", "tp2pp2"])
def test_tied_embedding_copies_stay_equal(runs, layout):
    for pair in ("qwen2", "llama"):  # the tied actors
        first, last = _stages(_layout(runs, layout)[pair], "actor")
        assert torch.equal(first["model.embed_tokens.weight"], last["model.embed_tokens.weight"])


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("layout", ["tp2", "tp2pp2"])
def test_tensor_parallel_padding_and_replicas(runs, layout, pair):
    for w in _layout(runs, layout)[pair]["weights"].values():
        assert w["padded_max"] == 0.0, "padded vocabulary rows must stay zero (no gradient, no decay)"
        assert w["replica_diff"] == 0.0, "TP-replicated parameters diverged between TP ranks"


def test_replica_check_catches_a_missing_qk_norm_reduction(runs):
    """Negative control: without the TP sum of Qwen3's q/k-norm gradients the TP copies drift apart
    and the update no longer matches TP1's (the fixture's TP1 run of the same qwen3 pair; the healthy
    TP2 run of it passes both checks in the tests above)."""
    broken = runs["broken"]
    assert max(w["replica_diff"] for w in broken["weights"].values()) > 0
    with pytest.raises(AssertionError):
        assert_metrics_match(runs["tp1"]["qwen3"]["result"], broken["result"], "broken")


@pytest.mark.parametrize("layout,pair", _cases(list(LAYOUTS)))
def test_policy_loss_moves_log_probs_in_the_direction_of_the_advantage(runs, layout, pair):
    d = _layout(runs, layout)[pair]["result"]["direction"]
    assert d["n_pos"] > 10 and d["n_neg"] > 10
    assert d["mean_delta_pos"] > 0 > d["mean_delta_neg"], d
    assert d["frac_right_direction"] > 0.8, d


@pytest.mark.parametrize("layout", DYNAMIC)
def test_token_budget_plans(runs, layout):
    """Every micro-batch of every pass within the budget; one micro-batch count per pass on every rank
    (pipeline stages, TP ranks, DP replicas); padding far below the fixed path's."""
    import json

    for pair in DYNAMIC_PAIRS:
        plans = _layout(runs, layout)[pair]["plans"]
        assert len(plans) == LAYOUTS[layout][2]
        passes = [p["micro_batch_tokens"] for p in plans.values()]
        # old log-probs, 2 epochs x 2 mini-batches of the actor, values, 2 x 2 of the critic
        assert all(len(p) == 10 for p in passes)
        for i in range(10):
            counts = {len(p[i]) for p in passes}
            assert len(counts) == 1, f"{layout} {pair} pass {i}: micro-batch counts differ {counts}"
            assert max(max(p[i]) for p in passes) <= MAX_TOKENS
        assert max(len(p[0]) for p in passes) > 1, "the budget should split the log-prob pass"
        # packed: the budget counts real tokens; the only padding is the TP multiple under SP
        most = 0.05 if layout in PACKED else 0.35
        assert all(p["padding"] < most for p in plans.values()), json.dumps(plans)
