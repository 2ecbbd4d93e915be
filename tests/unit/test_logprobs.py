"""Vocab-parallel log-probs/entropy at TP=1 against torch.log_softmax over the full vocabulary.

The TP=2 path (statistics all-reduced over a real gloo group) is checked against these TP=1 values in
tests/distributed/test_ppo_layouts.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.models.logprobs import vocab_parallel_log_probs_and_entropy

TP1 = SimpleNamespace(tp_size=1, tp_rank=0, tp_group=None)
VOCAB, PADDED = 11, 14  # 3 padding rows, as a model padded for TP would have


def oracle(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Full-vocabulary formula on the real rows only (float64)."""
    logp_all = torch.log_softmax(logits[..., :VOCAB].double() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def make(seed: int = 0, pad_value: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, PADDED, generator=g, dtype=torch.float32) * 3
    logits[..., VOCAB:] = pad_value
    targets = torch.randint(0, VOCAB, (2, 5), generator=g)
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_log_softmax(temperature):
    logits, targets = make()
    logp, ent = vocab_parallel_log_probs_and_entropy(
        logits, targets, TP1, VOCAB, temperature, with_entropy=True
    )
    ref_logp, ref_ent = oracle(logits, targets, temperature)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    # log-probs only: same values, a single tensor
    only = vocab_parallel_log_probs_and_entropy(logits, targets, TP1, VOCAB, temperature)
    torch.testing.assert_close(only, logp)


def test_temperature_changes_the_result():
    logits, targets = make()
    a = vocab_parallel_log_probs_and_entropy(logits, targets, TP1, VOCAB, 1.0)
    b = vocab_parallel_log_probs_and_entropy(logits, targets, TP1, VOCAB, 0.5)
    assert (a - b).abs().max() > 0.1
    torch.testing.assert_close(b.double(), oracle(logits, targets, 0.5)[0], atol=1e-5, rtol=1e-5)


def test_padded_vocab_rows_are_excluded():
    """Negative control: large logits on padding rows change an unmasked softmax, not this one."""
    logits, targets = make(pad_value=8.0)
    logp, ent = vocab_parallel_log_probs_and_entropy(logits, targets, TP1, VOCAB, with_entropy=True)
    ref_logp, ref_ent = oracle(logits, targets, 1.0)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    unmasked = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert (unmasked - ref_logp).abs().max() > 1.0, "the padded logits are too small to matter"
    # The model's own padding rows are zeros (not -inf): those must be excluded too.
    logits0, _ = make(pad_value=0.0)
    torch.testing.assert_close(
        vocab_parallel_log_probs_and_entropy(logits0, targets, TP1, VOCAB).double(),
        oracle(logits0, targets, 1.0)[0],
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_matches_autograd_of_full_vocab_formula(temperature):
    logits, targets = make(seed=1, pad_value=5.0)
    g = torch.Generator().manual_seed(2)
    w_logp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)

    x = logits.clone().requires_grad_(True)
    logp, ent = vocab_parallel_log_probs_and_entropy(x, targets, TP1, VOCAB, temperature, with_entropy=True)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()

    y = logits.double().requires_grad_(True)
    ref_logp, ref_ent = oracle(y, targets, temperature)
    ((ref_logp * w_logp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=1e-5)
    assert (x.grad[..., VOCAB:] == 0).all(), "padding rows must get no gradient"
    assert x.grad.abs().max() > 0.1

    # Entropy unused -> only the log-prob part of the gradient.
    x2 = logits.clone().requires_grad_(True)
    logp2, _ = vocab_parallel_log_probs_and_entropy(x2, targets, TP1, VOCAB, temperature, with_entropy=True)
    (logp2 * w_logp).sum().backward()
    y2 = logits.double().requires_grad_(True)
    (oracle(y2, targets, temperature)[0] * w_logp.double()).sum().backward()
    torch.testing.assert_close(x2.grad.double(), y2.grad, atol=1e-5, rtol=1e-5)


def test_bf16_logits_give_fp32_results_and_bf16_grads():
    logits, targets = make()
    x = logits.bfloat16().requires_grad_(True)
    logp = vocab_parallel_log_probs_and_entropy(x, targets, TP1, VOCAB)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(
        logp.double(), oracle(x.detach().float(), targets, 1.0)[0], atol=1e-5, rtol=1e-5
    )
    logp.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_bad_input_is_rejected():
    logits, targets = make()
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs_and_entropy(logits, targets, TP1, VOCAB, temperature=0.0)
    with pytest.raises(ValueError, match="do not match"):
        vocab_parallel_log_probs_and_entropy(logits, targets[:, :3], TP1, VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_log_probs_and_entropy(logits, targets, TP1, PADDED + 1)
