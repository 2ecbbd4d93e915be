"""Validation metrics at val_kwargs.n > 1 (reward/scoring.py ValidationScores) against a plain reference
of verl's process_validation_metrics: mean@n, std@n, best@k / worst@k / maj@k by bootstrap, and which of
them are val-core."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.reward.scoring import ValidationScores, bootstrap_sizes
from tests.conftest import single_ps

N = 4


def _a(acc: list[float], pred: list[float], scores: list[float]) -> tuple[str, list[dict], list[float]]:
    """A src_a prompt: its samples' acc and pred keys and their scores."""
    return "src_a", [{"acc": a, "pred": p} for a, p in zip(acc, pred, strict=True)], scores


def _b(scores: list[float]) -> tuple[str, list[dict], list[float]]:
    """A src_b prompt: scores only."""
    return "src_b", [{} for _ in scores], scores


# Prompts of two data sources, n = 4 samples each: (source, [extras of each sample], [scores]).
# src_a returns acc (the core variable) and a numeric pred; its preds tie in many subsets, so the
# majority vote's tie-break shows. src_b returns only a score.
PROMPTS: list[tuple[str, list[dict[str, float]], list[float]]] = [
    _a([1.0, 0.0, 1.0, 0.0], [3.0, 5.0, 3.0, 5.0], [1.0, 0.1, 0.9, -0.2]),
    _b([0.5, 0.25, 1.0, 0.0]),
    _a([0.0, 0.0, 0.0, 1.0], [7.0, 7.0, 7.0, 2.0], [0.3, 0.2, 0.1, 1.5]),
    _b([2.0, -1.0, 0.75, 0.5]),
    _a([0.0, 1.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 1.25, 0.5, 0.8]),
]


def _batch(prompts: list) -> tuple[RolloutBatch, torch.Tensor]:
    """A batch of the prompts' samples (n adjacent rows per prompt; the scorer reads meta) and scores [B]."""
    meta = [
        SeqMeta(uid=f"p{j}", data_source=source, reward_extras=dict(extras[i]))
        for j, (source, extras, _) in enumerate(prompts)
        for i in range(len(extras))
    ]
    ones = torch.ones(len(meta), 1, dtype=torch.long)
    batch = RolloutBatch.from_tokens(ones, ones, ones, ones, meta)
    return batch, torch.tensor([s for *_, scores in prompts for s in scores], dtype=torch.float64)


def _scored(prompts: list, n: int = N) -> dict[str, float]:
    scores = ValidationScores(n)
    batch, s = _batch(prompts)
    scores.add(batch, s, len(batch))
    return scores.metrics(single_ps())


# ---- reference: verl's definitions in plain python, one bootstrap subset at a time ----


def _vote(drawn: list[tuple[float, float]], ties: str) -> float:
    """The value of a majority vote over (pred, value) pairs in draw order. verl: the pred with the most
    votes, ties to the pred drawn first, its first draw's value. ``ties``: "verl" or a wrong variant."""
    counts: dict[float, int] = {}
    first: dict[float, float] = {}
    last: dict[float, float] = {}
    for pred, value in drawn:
        counts[pred] = counts.get(pred, 0) + 1
        first.setdefault(pred, value)
        last[pred] = value
    top = [p for p in counts if counts[p] == max(counts.values())]
    if ties == "last_pred":
        return first[top[-1]]
    if ties == "last_value":
        return last[top[0]]
    return first[top[0]]


def _bootstrap(rows: list, k: int, reduce, seed: int) -> tuple[float, float]:
    """Mean and population std of ``reduce`` over 1000 subsets of k rows, drawn as verl draws them."""
    state = np.random.get_state()
    np.random.seed(seed)
    idx = np.random.choice(len(rows), size=(1000, k), replace=True)
    np.random.set_state(state)
    results = [reduce([rows[i] for i in subset]) for subset in idx]
    mean = sum(results) / len(results)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in results) / len(results))


def _reference(prompts: list, n: int = N, variant: str = "verl") -> dict[str, float]:
    seed = 43 if variant == "other_seed" else 42
    best, worst = (min, max) if variant == "best_worst_swapped" else (max, min)
    ties = variant if variant in ("last_pred", "last_value") else "verl"
    per_prompt: dict[tuple[str, str, str], list[float]] = {}
    for source, extras, scores in prompts:
        variables = {"reward": list(scores)}
        for k in sorted({k for e in extras for k in e}):
            variables[k] = [e[k] for e in extras]
        for var, values in variables.items():
            mean = sum(values) / n
            metrics = {f"mean@{n}": mean}
            if n > 1:
                metrics[f"std@{n}"] = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
                ks = [2**i for i in range(1, 10) if 2**i < n] + [n]
                for k in ks:
                    metrics[f"best@{k}/mean"], metrics[f"best@{k}/std"] = _bootstrap(values, k, best, seed)
                    metrics[f"worst@{k}/mean"], metrics[f"worst@{k}/std"] = _bootstrap(values, k, worst, seed)
                    if "pred" in variables:
                        pairs = list(zip(variables["pred"], values, strict=True))
                        m = _bootstrap(pairs, k, lambda d: _vote(d, ties), seed)
                        metrics[f"maj@{k}/mean"], metrics[f"maj@{k}/std"] = m
            for name, value in metrics.items():
                per_prompt.setdefault((source, var, name), []).append(value)
    out = {}
    for (source, var, name), values in per_prompt.items():
        core_var = "acc" if any(s == source and v == "acc" for s, v, _ in per_prompt) else "reward"
        k = int(name.split("@")[1].split("/")[0])
        core = var == core_var and name.split("@")[0] in ("mean", "best", "maj") and k == n
        out[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = sum(values) / len(values)
    return out


# ---- tests ----


def test_bootstrap_sizes_are_verls():
    assert bootstrap_sizes(1) == []
    assert bootstrap_sizes(2) == [2]
    assert bootstrap_sizes(4) == [2, 4]
    assert bootstrap_sizes(5) == [2, 4, 5]
    assert bootstrap_sizes(16) == [2, 4, 8, 16]
    assert bootstrap_sizes(24) == [2, 4, 8, 16, 24]


def test_metric_names_at_n4():
    out = _scored(PROMPTS)
    acc = {
        "val-core/src_a/acc/mean@4",
        "val-aux/src_a/acc/std@4",
        "val-aux/src_a/acc/best@2/mean",
        "val-aux/src_a/acc/best@2/std",
        "val-aux/src_a/acc/worst@2/mean",
        "val-aux/src_a/acc/worst@2/std",
        "val-aux/src_a/acc/maj@2/mean",
        "val-aux/src_a/acc/maj@2/std",
        "val-core/src_a/acc/best@4/mean",
        "val-core/src_a/acc/best@4/std",
        "val-aux/src_a/acc/worst@4/mean",
        "val-aux/src_a/acc/worst@4/std",
        "val-core/src_a/acc/maj@4/mean",
        "val-core/src_a/acc/maj@4/std",
    }
    src_b = {
        "val-core/src_b/reward/mean@4",
        "val-aux/src_b/reward/std@4",
        "val-aux/src_b/reward/best@2/mean",
        "val-aux/src_b/reward/best@2/std",
        "val-aux/src_b/reward/worst@2/mean",
        "val-aux/src_b/reward/worst@2/std",
        "val-core/src_b/reward/best@4/mean",
        "val-core/src_b/reward/best@4/std",
        "val-aux/src_b/reward/worst@4/mean",
        "val-aux/src_b/reward/worst@4/std",
    }
    # src_a's reward and pred are not its core variable (acc is): all val-aux, maj included.
    others = {f"val-aux/src_a/{var}/{name.split('/', 3)[3]}" for var in ("reward", "pred") for name in acc}
    assert set(out) == acc | src_b | others
    assert len(out) == 3 * 14 + 10


def test_values_match_the_reference():
    assert _scored(PROMPTS) == pytest.approx(_reference(PROMPTS), rel=1e-12, abs=1e-12)


def test_data_parallel_ranks_combine_to_the_whole():
    # Rank r of two holds prompts r, r + 2, ...; summing their per-key stats is the DP all-reduce.
    ranks = [ValidationScores(N), ValidationScores(N)]
    for r, scores in enumerate(ranks):
        batch, s = _batch(PROMPTS[r::2])
        scores.add(batch, s, len(batch))
    keys = sorted({"\t".join(k) for scores in ranks for k in scores.sums})
    total = ranks[0]._stats(keys) + ranks[1]._stats(keys)
    assert ranks[0]._named(keys, total) == pytest.approx(_reference(PROMPTS), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("variant", ["best_worst_swapped", "last_pred", "last_value", "other_seed"])
def test_a_wrong_reference_does_not_match(variant):
    # The comparison can fail: each of verl's choices (max for best, ties to the pred drawn first and
    # its first draw's value, seed 42) changes some value when done otherwise.
    out, wrong = _scored(PROMPTS), _reference(PROMPTS, variant=variant)
    assert set(out) == set(wrong)
    assert out != pytest.approx(wrong, rel=1e-9, abs=1e-9)


def test_n1_logs_mean_only():
    prompts = [(source, extras[:1], scores[:1]) for source, extras, scores in PROMPTS]
    out = _scored(prompts, n=1)
    assert out == pytest.approx(
        {
            "val-core/src_a/acc/mean@1": (1.0 + 0.0 + 0.0) / 3,
            "val-aux/src_a/reward/mean@1": (1.0 + 0.3 + 0.0) / 3,
            "val-aux/src_a/pred/mean@1": (3.0 + 7.0 + 1.0) / 3,
            "val-core/src_b/reward/mean@1": (0.5 + 2.0) / 2,
        }
    )
    assert out == pytest.approx(_reference(prompts, n=1))


def test_a_key_missing_on_some_samples_skips_the_prompts_bootstrap():
    # The second prompt's "acc" is on 3 of 4 samples: its mean@4/std@4 use those 3, no bootstrap.
    prompts = [PROMPTS[0], ("src_a", [{"acc": 1.0}, {"acc": 0.0}, {}, {"acc": 1.0}], [1.0, 0.0, 0.0, 1.0])]
    out = _scored(prompts)
    only_first = _reference(prompts[:1])
    assert out["val-core/src_a/acc/mean@4"] == pytest.approx((0.5 + 2 / 3) / 2)
    assert out["val-aux/src_a/acc/std@4"] == pytest.approx((0.5 + math.sqrt(2 / 9)) / 2)
    assert out["val-core/src_a/acc/best@4/mean"] == pytest.approx(
        only_first["val-core/src_a/acc/best@4/mean"]
    )
    # No pred on the second prompt: maj@k is the first prompt's alone.
    assert out["val-core/src_a/acc/maj@4/mean"] == pytest.approx(only_first["val-core/src_a/acc/maj@4/mean"])
