"""Vocab-parallel log-probs/entropy at TP=1 against torch.log_softmax over the full vocabulary.

The TP=2 path (statistics all-reduced over a real gloo group) is checked against these TP=1 values in
tests/distributed/test_ppo_layouts.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.models.logprobs import fused_log_probs_and_entropy, vocab_parallel_log_probs_and_entropy

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


# --------------------------------------------------------------------------------------------------
# The fused, chunked head: hidden states and the output weight in, no [tokens, V] logits at once
# --------------------------------------------------------------------------------------------------

HIDDEN = 8


def make_head(seed: int = 3, dtype=torch.float32):
    """hidden [2, 5, h], weight [V_pad, h] with large padding rows (their logits would dominate an
    unmasked softmax), targets [2, 5]; O(1) entries, so |logits| ~ 3."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, HIDDEN, generator=g)
    weight = torch.randn(PADDED, HIDDEN, generator=g)
    weight[VOCAB:] *= 4.0
    targets = torch.randint(0, VOCAB, (2, 5), generator=g)
    return hidden.to(dtype), weight.to(dtype), targets


def head_oracle(hidden, weight, targets, temperature, w_logp, w_ent):
    """float64 autograd through the full-vocabulary formula: (log p, entropy, grad hidden, grad weight)."""
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logp, ent = oracle(h @ w.T, targets, temperature)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def fused_run(hidden, weight, targets, temperature, w_logp, w_ent, **kw):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = fused_log_probs_and_entropy(h, w, targets, TP1, VOCAB, temperature, with_entropy=True, **kw)
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    return logp, ent, h.grad, w.grad


def assert_head_close(got, want, tol: float = 2e-5):
    for name, a, b in zip(("log-probs", "entropy", "grad hidden", "grad weight"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol, msg=name)


@pytest.mark.parametrize("chunk", [1, 3, 10, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_head_matches_the_full_vocab_formula_values_and_gradients(chunk, temperature):
    hidden, weight, targets = make_head()
    g = torch.Generator().manual_seed(4)
    w_logp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    want = head_oracle(hidden, weight, targets, temperature, w_logp.double(), w_ent.double())
    got = fused_run(hidden, weight, targets, temperature, w_logp, w_ent, chunk_tokens=chunk)
    assert_head_close(got, want)
    assert (got[3][VOCAB:] == 0).all(), "padding rows of the weight must get no gradient"
    assert got[2].abs().max() > 0.1 and got[3].abs().max() > 0.1
    # the unfused path (materialised logits, then the vocab-parallel log-softmax) agrees too
    logits = hidden @ weight.T
    ref_logp, ref_ent = vocab_parallel_log_probs_and_entropy(
        logits, targets, TP1, VOCAB, temperature, with_entropy=True
    )
    torch.testing.assert_close(got[0], ref_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], ref_ent, atol=1e-6, rtol=1e-6)


def test_fused_head_negative_controls_are_caught():
    """A chunk that reads the hidden states one token off, a softmax over the padding rows, or a
    temperature not applied: each breaks the comparison above."""
    hidden, weight, targets = make_head()
    g = torch.Generator().manual_seed(4)
    w_logp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    want = head_oracle(hidden, weight, targets, 0.6, w_logp.double(), w_ent.double())
    flat = hidden.reshape(10, HIDDEN)
    shifted = torch.cat([flat[:3], flat[4:7], flat[3:4], flat[7:]]).reshape(
        2, 5, HIDDEN
    )  # chunk 2 off by one
    with pytest.raises(AssertionError):
        assert_head_close(fused_run(shifted, weight, targets, 0.6, w_logp, w_ent, chunk_tokens=3), want)
    unmasked = SimpleNamespace(tp_size=1, tp_rank=0, tp_group=None)
    logp_all = fused_log_probs_and_entropy(hidden, weight, targets, unmasked, PADDED, 0.6)  # padding counted
    assert (logp_all.double() - want[0]).abs().max() > 0.1
    with pytest.raises(AssertionError):
        assert_head_close(fused_run(hidden, weight, targets, 1.0, w_logp, w_ent), want)


def test_fused_head_entropy_as_a_metric_only_gets_no_gradient():
    hidden, weight, targets = make_head()
    g = torch.Generator().manual_seed(5)
    w_logp = torch.randn(2, 5, generator=g)
    zero = torch.zeros(2, 5)
    want = head_oracle(hidden, weight, targets, 0.8, w_logp.double(), zero.double())
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, ent = fused_log_probs_and_entropy(
        h, w, targets, TP1, VOCAB, 0.8, with_entropy=True, entropy_grad=False, chunk_tokens=4
    )
    assert not ent.requires_grad
    (logp * w_logp).sum().backward()
    assert_head_close((logp, ent, h.grad, w.grad), want)
    # log-probs alone (the old/ref passes): the same values as with the entropy
    only = fused_log_probs_and_entropy(hidden, weight, targets, TP1, VOCAB, 0.8, chunk_tokens=4)
    assert torch.equal(only, logp.detach())


def test_fused_head_bf16_gives_fp32_results_and_bf16_grads():
    hidden, weight, targets = make_head(dtype=torch.bfloat16)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = fused_log_probs_and_entropy(h, w, targets, TP1, VOCAB, chunk_tokens=4)
    assert logp.dtype == torch.float32
    ref = vocab_parallel_log_probs_and_entropy(hidden @ weight.T, targets, TP1, VOCAB)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)  # the same bf16 matmul, fp32 after
    logp.sum().backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16


def test_fused_head_bad_input_is_rejected():
    hidden, weight, targets = make_head()
    with pytest.raises(ValueError, match="temperature"):
        fused_log_probs_and_entropy(hidden, weight, targets, TP1, VOCAB, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_log_probs_and_entropy(hidden, weight, targets, TP1, VOCAB, chunk_tokens=0)
    with pytest.raises(ValueError, match="do not match"):
        fused_log_probs_and_entropy(hidden, weight, targets[:, :3], TP1, VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        fused_log_probs_and_entropy(hidden, weight, targets, TP1, PADDED + 1)


# --------------------------------------------------------------------------------------------------
# The fused head in a megatron GPTModel: the output layer's matmul replaced, the same values and grads
# --------------------------------------------------------------------------------------------------


def tiny_model(ps, path: str, tie: bool):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.random_hf import save_random_hf_model

    save_random_hf_model(path, "qwen2", num_hidden_layers=1, tie_word_embeddings=tie)
    model = build_model(load_model_args(path), ps, "actor", dtype=torch.float32)
    load_hf_weights(model, path, ps)
    return model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_model_with_the_fused_head_equals_the_logits_path(ps, tmp_path, tie):
    """Log-probs, entropies and every parameter's gradient (the tied embedding or the output layer
    included) of a GPTModel whose head is the fused op equal those of its logits + log-softmax."""
    from megatron_rl import cpu_bridge
    from megatron_rl.models.forward import causal_padding_mask, output_positions

    model = tiny_model(ps, str(tmp_path / "m"), tie)
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 7), generator=g)
    mask = causal_padding_mask(torch.ones_like(ids))
    where, targets = slice(2, 6), ids[:, 3:7]  # positions 2..5 predict tokens 3..6
    w_logp, w_ent = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    def head(hidden, weight):  # [r, b, h] -> [r, b, 2]
        out = fused_log_probs_and_entropy(hidden, weight, targets.T, ps, vocab, 0.7, True, chunk_tokens=5)
        return torch.stack(out, -1)

    results = []
    for fused in (True, False):
        model.zero_grad()
        with cpu_bridge.device_mode(), output_positions(model, lambda: where, head if fused else None):
            out = model(ids, None, mask)
        if fused:
            logp, ent = out[..., 0], out[..., 1]
        else:
            assert out.shape[:2] == (3, 4) and out.shape[2] >= vocab  # [b, r, V_pad] logits
            logp, ent = vocab_parallel_log_probs_and_entropy(out, targets, ps, vocab, 0.7, with_entropy=True)
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logp.detach(), ent.detach(), grads))
    (lp_f, ent_f, grads_f), (lp_u, ent_u, grads_u) = results
    torch.testing.assert_close(lp_f, lp_u, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_f, ent_u, atol=1e-5, rtol=1e-5)
    assert grads_f.keys() == grads_u.keys()
    head_weight = "embedding.word_embeddings.weight" if tie else "output_layer.weight"
    assert grads_u[head_weight].abs().max() > 0.01
    for name, grad in grads_u.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert "forward" not in vars(model.output_layer), "the head's forward is restored after the pass"
