"""The weight sync's per-tensor checksums (rollout.checksums.tensor_checksum): equal for the same values
summed in another order, different for any permutation, swap, stale or scaled copy."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.checksums import (
    _CHECKSUM_CHUNK,
    CHECKSUM_SIZE,
    box_checksum,
    checksums_match,
    missing_checksum,
    tensor_checksum,
)


def match(a: torch.Tensor, b: torch.Tensor) -> bool:
    want, have = tensor_checksum(a)[None], tensor_checksum(b)[None]
    return bool(checksums_match(want, have, torch.tensor([a.numel()]))[0])


@pytest.fixture
def w() -> torch.Tensor:
    return torch.randn(64, 48, generator=torch.Generator().manual_seed(0))  # O(1) weights


def test_the_same_values_match_in_any_layout_and_dtype(w):
    assert tensor_checksum(w).shape == (CHECKSUM_SIZE,)
    assert match(w, w.clone())
    assert match(w, w.t().contiguous().t())  # a non-contiguous view is read in row-major order
    b = w.to(torch.bfloat16)
    assert match(b, b.float())  # an engine holding the streamed bf16 values in fp32


def test_the_same_values_summed_in_another_order_match(w):
    x = w.reshape(-1).to(torch.float64)
    reference = tensor_checksum(w)
    positional = reference[2]
    # the three sums accumulated one element at a time, back to front: another rounding, same values
    s = torch.zeros(CHECKSUM_SIZE, dtype=torch.float64)
    weights = torch.frac(torch.arange(x.numel(), dtype=torch.float64) * ((5**0.5 - 1) / 2)) - 0.5
    for i in reversed(range(x.numel())):
        s[0] += x[i]
        s[1] += x[i] * x[i]
        s[2] += x[i] * weights[i]
    assert torch.allclose(s[2], positional, rtol=1e-12, atol=0)
    assert bool(checksums_match(reference[None], s[None], torch.tensor([x.numel()]))[0])


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda t: t.flip(0),  # rows reversed
        lambda t: t.flip(1),  # columns reversed
        lambda t: t.t().reshape(t.shape),  # a transpose read as the original shape
        lambda t: torch.roll(t, 1, 0),  # shifted by a row
        lambda t: t * (1 + 1e-3),  # scaled
        lambda t: torch.zeros_like(t),  # never written
    ],
    ids=["rows-reversed", "cols-reversed", "transposed", "rolled", "scaled", "zeros"],
)
def test_a_permuted_shifted_or_scaled_copy_does_not_match(w, corrupt):
    assert not match(w, corrupt(w).contiguous())


def test_two_swapped_elements_do_not_match_anywhere(w):
    g = torch.Generator().manual_seed(1)
    flat = w.reshape(-1)
    for _ in range(200):
        i, j = torch.randint(flat.numel(), (2,), generator=g).tolist()
        if flat[i] == flat[j]:
            continue
        c = flat.clone()
        c[i], c[j] = flat[j], flat[i]
        assert not match(w, c.view_as(w)), (i, j)


def test_a_swap_across_chunks_at_the_same_offset_does_not_match():
    n = _CHECKSUM_CHUNK + 64  # two chunks; offset 3 of each swapped
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    c = x.clone()
    c[3], c[_CHECKSUM_CHUNK + 3] = x[_CHECKSUM_CHUNK + 3], x[3]
    assert match(x, x.clone())
    assert not match(x, c)


def test_a_bf16_ulp_is_seen_and_a_missing_tensor_matches_nothing(w):
    b = w.to(torch.bfloat16)
    c = b.clone()
    c.view(-1)[100] = (c.view(-1)[100].float() * (1 + 2**-7)).to(torch.bfloat16)  # one bf16 step
    assert c.view(-1)[100] != b.view(-1)[100]
    assert not match(b, c)
    z = torch.zeros(8)
    assert match(z, z.clone())
    missing = missing_checksum()[None]
    assert not bool(checksums_match(tensor_checksum(z)[None], missing, torch.tensor([8]))[0])


def test_shards_of_a_tensor_add_up_to_its_checksum(w):
    """An engine holding tensor-parallel shards checks them box by box (rollout.sglang_loader)."""
    full = tensor_checksum(w)[None]
    n = torch.tensor([w.numel()])
    rows = sum(box_checksum(w[r : r + 16], 48, row0=r) for r in range(0, 64, 16))  # column-parallel
    cols = sum(box_checksum(w[:, c : c + 12], 48, col0=c) for c in range(0, 48, 12))  # row-parallel
    assert bool(checksums_match(full, rows[None], n)[0])
    assert bool(checksums_match(full, cols[None], n)[0])
    bias = w[0]
    halves = box_checksum(bias[:24], 1) + box_checksum(bias[24:], 1, row0=24)
    assert bool(checksums_match(tensor_checksum(bias)[None], halves[None], torch.tensor([48]))[0])
    # negative controls: two shards at each other's place, a shard counted twice
    swapped = box_checksum(w[16:32], 48, row0=0) + box_checksum(w[0:16], 48, row0=16)
    swapped += sum(box_checksum(w[r : r + 16], 48, row0=r) for r in range(32, 64, 16))
    assert not bool(checksums_match(full, swapped[None], n)[0])
    assert not bool(checksums_match(full, (rows + box_checksum(w[:16], 48))[None], n)[0])


def test_box_weights_across_chunks_are_those_of_the_whole_tensor():
    x = torch.randn(3, _CHECKSUM_CHUNK // 2 + 5, generator=torch.Generator().manual_seed(3))
    parts = box_checksum(x[:, :1000], x.shape[1]) + box_checksum(x[:, 1000:], x.shape[1], col0=1000)
    assert bool(checksums_match(tensor_checksum(x)[None], parts[None], torch.tensor([x.numel()]))[0])
