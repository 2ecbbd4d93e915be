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
    if device not in _position_weights:
        j = torch.arange(_CHECKSUM_CHUNK, dtype=torch.float64, device=device)
        _position_weights[device] = torch.frac(j * _PHI) - 0.5
    return _position_weights[device]


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """[CHECKSUM_SIZE] float64 on ``t``'s device: (sum, sum of squares, sum weighted by position) of its
    elements in row-major order. Cheap (one pass over ``t`` in float64 chunks); a dropped, stale,
    shifted or scaled tensor changes the first two, a permuted one (rows reversed, two elements swapped)
    the third. Chunk k's position weights are those of chunk 0 times (1 + k * phi mod 1), so that equal
    offsets in two chunks weigh differently as well."""
    out = torch.zeros(CHECKSUM_SIZE, dtype=torch.float64, device=t.device)
    w = _weights(t.device)
    for k, chunk in enumerate(t.detach().reshape(-1).split(_CHECKSUM_CHUNK)):
        x = chunk.to(torch.float64)
        out[0] += x.sum()
        out[1] += x.square().sum()
        out[2] += torch.dot(x, w[: x.numel()]) * (1.0 + (k * _PHI) % 1.0)
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
