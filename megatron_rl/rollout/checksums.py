"""Per-tensor checksums of the weight sync: the stream records one for every tensor it hands the
engine, the engine computes the same over its own copy, and :func:`checksums_match` compares them
(rollout.reshard.check_weights; roles.remote_rollout for a rollout on ranks of its own)."""

from __future__ import annotations

import math

import torch

CHECKSUM_SIZE = 3
"""Entries of one tensor's checksum (:func:`tensor_checksum`)."""

_CHECKSUM_CHUNK = 1 << 22  # elements converted to float64 at a time (32 MiB)
_PHI = (math.sqrt(5.0) - 1.0) / 2.0
_position_weights: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """[_CHECKSUM_CHUNK] float64 frac(j * phi) - 1/2, made once per device: weights that differ between
    any two nearby positions (the golden ratio's multiples spread evenly over [0, 1))."""
    if device not in _position_weights:  # chunk 0's weights (its multiplier is 1)
        _position_weights[device] = position_weights(torch.arange(_CHECKSUM_CHUNK, device=device))
    return _position_weights[device]


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """[CHECKSUM_SIZE] float64 on ``t``'s device: (sum, sum of squares, sum weighted by position) of its
    elements in row-major order. Cheap (one pass over ``t``: a fused kernel on CUDA, float64 chunks
    elsewhere); a dropped, stale, shifted or scaled tensor changes the first two, a permuted one (rows
    reversed, two elements swapped) the third. The element at flat index i = k * chunk + j weighs
    frac(j * phi) - 1/2 times (1 + frac(k * phi)), so that equal offsets in two chunks weigh
    differently as well."""
    return box_checksum(t.reshape(-1), 1)


def _range_checksum(flat: torch.Tensor, start: int) -> torch.Tensor:
    """The share in a tensor's checksum of its elements start..start + len(flat) (``flat``, 1-D): one
    float64 block per chunk of flat indices, weighted from the cached table."""
    out = torch.zeros(CHECKSUM_SIZE, dtype=torch.float64, device=flat.device)
    w = _weights(flat.device)
    pos, n = 0, flat.numel()
    while pos < n:
        k, j = divmod(start + pos, _CHECKSUM_CHUNK)
        take = min(_CHECKSUM_CHUNK - j, n - pos)
        x = flat[pos : pos + take].to(torch.float64)
        out[0] += x.sum()
        out[1] += torch.dot(x, x)
        out[2] += torch.dot(x, w[j : j + take]) * (1.0 + (k * _PHI) % 1.0)
        pos += take
    return out


def missing_checksum(device: torch.device | str = "cpu") -> torch.Tensor:
    """The checksum of a tensor an engine does not hold: NaNs, which match nothing."""
    return torch.full((CHECKSUM_SIZE,), math.nan, dtype=torch.float64, device=device)


def checksums_match(want: torch.Tensor, have: torch.Tensor, numel: torch.Tensor) -> torch.Tensor:
    """[n] bool: rows of [n, CHECKSUM_SIZE] checksums equal up to float64 rounding of another summation
    order (``numel`` [n]: each tensor's elements). The bound is 1e-11 of the sum of magnitudes each
    entry adds up (sum |x| <= sqrt(numel * sum x^2)); float64 sums of up to 2^32 terms stay within
    1e-13 of it, while one swap of two different values moves the weighted entry by about their
    difference."""
    sq = want[:, 1].clamp(min=0)
    mag = (numel.to(torch.float64).clamp(min=1) * sq).sqrt()
    scale = torch.stack([mag, sq, 2.0 * mag], dim=1)
    tol = 1e-11 * scale + 1e-300
    return ((want - have).abs() <= tol).all(dim=1)


def first_mismatch(
    names: list[str],
    want: torch.Tensor,
    got: dict[str, torch.Tensor],
    numel: torch.Tensor,
    unread: set[str] | tuple = (),
) -> int | None:
    """The index of the first of ``names`` whose engine checksum (``got``) differs from the streamed
    one (``want`` [n, CHECKSUM_SIZE]; ``numel`` [n]), or None. A name ``got`` lacks differs, unless it
    is in ``unread`` (held by the engine, which cannot read it back): those are not compared."""
    missing = missing_checksum(want.device)
    have = torch.stack(
        [want[i] if n in unread else got.get(n, missing).to(want.device) for i, n in enumerate(names)]
    )
    bad = (~checksums_match(want, have, numel)).nonzero()
    return int(bad[0, 0]) if len(bad) else None


_FUSED: list[bool] = []


def _fused() -> bool:
    """Triton is importable (the fused CUDA kernel, rollout.checksum_kernel); checked once."""
    if not _FUSED:
        import importlib.util

        _FUSED.append(importlib.util.find_spec("triton") is not None)
    return _FUSED[0]


def position_weights(index: torch.Tensor) -> torch.Tensor:
    """float64 weights of the flat (row-major) element indices ``index`` (int64, any shape), equal to
    those :func:`tensor_checksum` gives the same positions."""
    j = (index % _CHECKSUM_CHUNK).to(torch.float64)
    k = (index // _CHECKSUM_CHUNK).to(torch.float64)
    return (torch.frac(j * _PHI) - 0.5) * (1.0 + torch.remainder(k * _PHI, 1.0))


def box_checksum(values: torch.Tensor, cols: int, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """[CHECKSUM_SIZE] float64: the share of ``values`` in the :func:`tensor_checksum` of a tensor it is a
    box of. ``values`` [h, w] holds rows row0..row0+h and columns col0..col0+w of a 2-D tensor with
    ``cols`` columns (a 1-D ``values`` [h]: elements row0..row0+h of a 1-D tensor, ``cols`` = 1). The
    shares of boxes that tile a tensor add up to its checksum, to float64 rounding: an engine that
    holds a tensor in tensor-parallel shards checks its copy shard by shard."""
    v = values.detach()
    v = v[:, None] if v.dim() == 1 else v
    h, w = v.shape
    if v.is_cuda and _fused():
        from megatron_rl.rollout import checksum_kernel

        return checksum_kernel.box_checksum(v, cols, row0, col0, _CHECKSUM_CHUNK, _PHI)
    if w == cols:  # whole rows: one run of flat indices, weighted from the cached table
        return _range_checksum(v.reshape(-1), row0 * cols)
    out = torch.zeros(CHECKSUM_SIZE, dtype=torch.float64, device=v.device)
    step = max(1, _CHECKSUM_CHUNK // max(w, 1))  # rows per float64 block
    columns = torch.arange(w, dtype=torch.int64, device=v.device) + col0
    for r in range(0, h, step):
        x = v[r : r + step].to(torch.float64)
        rows = torch.arange(r, r + x.shape[0], dtype=torch.int64, device=v.device) + row0
        out[0] += x.sum()
        out[1] += x.square().sum()
        out[2] += (x * position_weights(rows[:, None] * cols + columns[None, :])).sum()
    return out
