"""LoRA into the rollout engine without the base (lora.merge=false, rollout.lora_sync) on the transformers
engine, against the merged stream (lora.merge=true) of the same actor: the tiny Qwen2 of test_lora.py
with O(1) PEFT adapters, at TP2, PP2 and TP1 x DP2 (workers/lora_engine.py). Greedy and sampled
generations (same seeds) must match in tokens and, within fp32 rounding, log-probs; the first sync
streams the base (every weight tensor, the merged stream's names and bytes) and the adapters, a second
one the adapters alone; the actor's log-probs of the engine's tokens agree (what the sync-integrity
probe checks). Negative control: the engine without its adapters' hooks generates something else."""

import pytest
import torch

from tests.conftest import run_torchrun
from tests.distributed.test_lora import _peft_model

TOL = 1e-4  # fp32: W x + s B (A x) against (W + s B A) x, different summation orders
PROBE_TOL = 1e-3  # roles.sync_check's fp32 tolerance
LAYOUTS = ("tp2", "pp2", "dp2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("lora_engine")
    path = save_random_hf_model(str(root / "qwen2"), "qwen2", seed=7)
    _peft_model(path, seed=11).save_pretrained(str(root / "peft"))
    res = str(root / "res.pt")
    run_torchrun("lora_engine.py", 2, ["--model", path, "--peft", str(root / "peft"), "--out", res])
    return torch.load(res)


def _same(a: dict, b: dict, where: str) -> None:
    for kind in ("greedy", "sampled"):
        for i, (ra, rb) in enumerate(zip(a[kind], b[kind], strict=True)):
            for (ta, la), (tb, lb) in zip(ra, rb, strict=True):
                assert ta == tb, f"{where} {kind} prompt {i}: tokens {ta} != {tb}"
                err = (la - lb).abs().max().item()
                assert err < TOL, f"{where} {kind} prompt {i}: log-probs differ by {err:.2e}"


def _greedy(gens: dict) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy response: (tokens, log-probs)."""
    return [row[0] for row in gens["greedy"]]


def _lp_gap(a: dict, b: dict) -> float:
    """Largest |difference| of the greedy log-probs over the common length of each prompt's responses."""
    gaps = []
    for (_, la), (_, lb) in zip(_greedy(a), _greedy(b), strict=True):
        k = min(len(la), len(lb))
        gaps.append((la[:k] - lb[:k]).abs().max().item())
    return max(gaps)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unmerged_engine_generates_as_merged(runs, layout):
    r = runs[layout]
    _same(r["merged"], r["unmerged"], f"{layout} first sync")
    _same(r["merged2"], r["unmerged2"], f"{layout} second sync")
    moved = _lp_gap(r["merged"], r["merged2"]) > 100 * TOL or _greedy(r["merged"]) != _greedy(r["merged2"])
    assert moved, "the adapters' step did not change the policy: the second sync proves nothing"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_crossed(runs, layout):
    r = runs[layout]
    full, first, second = r["merged_crossed"], r["first_crossed"], r["second_crossed"]
    assert full["buckets"] and not full["adapters"]
    # the first sync: the base, tensor for tensor the merged stream's (names and bytes), then adapters
    assert first["buckets"] == full["buckets"]
    names = sorted(n for n, _ in first["adapters"])
    assert names and all(n.startswith("base_model.model.model.layers.") for n in names)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    # the second: the adapters alone
    assert second["buckets"] == []
    assert sorted(n for n, _ in second["adapters"]) == names
    adapter_bytes = sum(b for _, b in second["adapters"])
    assert r["second_sync"]["bytes"] == adapter_bytes == r["second_sync"]["adapter_bytes"]
    assert r["first_sync"]["bytes"] == sum(b for _, b in full["buckets"]) + adapter_bytes


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_engine_logprobs_are_the_actors(runs, layout):
    r = runs[layout]
    for (_, engine_lp), actor_lp in zip(_greedy(r["unmerged"]), r["actor"], strict=True):
        err = (engine_lp - actor_lp).abs().max().item()
        assert err < PROBE_TOL, f"{layout}: the engine's log-probs differ from the actor's by {err:.2e}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_control_adapters_off(runs, layout):
    r = runs[layout]
    assert _lp_gap(r["unmerged2"], r["hooks_off"]) > 100 * TOL, (
        "the engine without its adapters generates as with them"
    )
