"""The fused, chunked LM head + log-softmax at TP=2 over a real gloo group (torchrun, 2 ranks; the
worker is workers/fused_logprobs.py).

Each rank holds half of the output weight's rows ([V_pad/2, h], padding rows at the end of rank 1; with
vocab 6 rank 1 holds padding only). Oracle: float64 autograd through log_softmax over the full, unpadded
vocabulary of hidden @ W^T / temperature. Every rank must return the oracle's log-probs and entropies,
the oracle's gradient of the hidden states (the TP sum of both shards' parts) and the oracle's gradient
rows of its own weight shard. Negative controls: a shard offset taken from the other rank, and every
collective run over a group of one (the TP reductions missing), must both break that comparison.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_torchrun

PADDED, HIDDEN, TEMPERATURE, CHUNK = 14, 8, 0.6, 3
TOL = 2e-5  # fp32 against float64; observed <= 1e-6
MODES = ("tp2", "swapped_offset", "no_reduction")
VOCABS = (11, 6)  # rank 1: 4 real rows and 3 padding rows; padding only


def data(vocab: int):
    """hidden [2, 5, h], full weight [V_pad, h] (padding rows large), targets, loss weights; O(1)."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 5, HIDDEN, generator=g)
    weight = torch.randn(PADDED, HIDDEN, generator=g)
    weight[vocab:] *= 4.0
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    targets[0, :2] = torch.tensor([0, vocab - 1])  # both shards own some targets
    return hidden, weight, targets, torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)


def oracle(vocab: int):
    hidden, weight, targets, w_logp, w_ent = data(vocab)
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logp_all = torch.log_softmax((h @ w.T)[..., :vocab] / TEMPERATURE, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * w_logp.double()).sum() + (ent * w_ent.double()).sum()).backward()
    return {"logp": logp.detach(), "ent": ent.detach(), "grad_h": h.grad, "grad_w": w.grad}


def mismatch(got: dict, want: dict, rank: int) -> float:
    """The largest difference of any output of one rank from the oracle."""
    local = PADDED // 2
    diffs = [(got[k].double() - want[k]).abs().max().item() for k in ("logp", "ent", "grad_h")]
    diffs.append(
        (got["grad_w"].double() - want["grad_w"][rank * local : (rank + 1) * local]).abs().max().item()
    )
    return max(diffs)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' outputs (tests/distributed/workers/fused_logprobs.py): [rank][vocab][mode]."""
    out = tmp_path_factory.mktemp("fused")
    run_torchrun("fused_logprobs.py", 2, ["--out", str(out)])
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("vocab", VOCABS, ids=["padded-shard", "padding-only-shard"])
def test_fused_head_at_tp2_matches_the_full_vocabulary_oracle(ranks, vocab):
    want = oracle(vocab)
    assert want["grad_w"][: PADDED // 2].abs().max() > 0.1 and want["grad_h"].abs().max() > 0.1
    got = [r[vocab] for r in ranks]
    for rank in range(2):
        assert mismatch(got[rank]["tp2"], want, rank) < TOL, rank
        assert (got[rank]["tp2"]["grad_w"][max(0, vocab - rank * PADDED // 2) :] == 0).all(), "padding rows"
    # negative controls: the same comparison catches a wrong shard offset and missing TP sums on some
    # rank (with vocab 6 rank 0 holds the whole vocabulary, and only rank 1 goes wrong: NaN, no mass)
    for mode in ("swapped_offset", "no_reduction"):
        assert not all(mismatch(got[rank][mode], want, rank) < TOL for rank in range(2)), mode
