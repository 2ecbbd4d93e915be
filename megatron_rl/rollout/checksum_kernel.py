"""The weight-sync checksum (rollout.checksums) as one fused Triton kernel for CUDA tensors: each
element read once in its own dtype, its float64 value, square and position weight summed per block,
the blocks' partial sums added by torch. The same numbers as the torch path (each term exact in
float64, another summation order), at the device's read bandwidth rather than that of four float64
passes. Imported only where CUDA and Triton are (checksums.box_checksum decides)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_phi: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _box_kernel(
    x_ptr, out_ptr, phi_ptr, width, row_stride, start, cols,
    SHIFT: tl.constexpr, BLOCK: tl.constexpr, FLAT: tl.constexpr,
):  # fmt: skip
    # Element flat index i = k * 2^SHIFT + j (in the whole tensor) weighs frac(j phi) - 1/2 times
    # 1 + frac(k phi) (rollout.checksums.position_weights); shifts and masks, no 64-bit division.
    phi = tl.load(phi_ptr)  # float64 (a float argument would arrive as float32)
    if FLAT:  # ``width`` contiguous elements at flat indices start..: one block per program
        slot = tl.program_id(0).to(tl.int64)
        e = slot * BLOCK + tl.arange(0, BLOCK)
        mask = e < width
        x = tl.load(x_ptr + e, mask=mask, other=0.0).to(tl.float64)
        idx = start + e
    else:  # row r of a box, ``width`` of its columns: flat indices start + r * cols + c
        r = tl.program_id(0).to(tl.int64)
        cb = tl.program_id(1).to(tl.int64)
        c = cb * BLOCK + tl.arange(0, BLOCK)
        mask = c < width
        x = tl.load(x_ptr + r * row_stride + c, mask=mask, other=0.0).to(tl.float64)
        idx = start + r * cols + c
        slot = r * tl.num_programs(1).to(tl.int64) + cb
    a = (idx & ((1 << SHIFT) - 1)).to(tl.float64) * phi
    b = (idx >> SHIFT).to(tl.float64) * phi
    w = (a - tl.floor(a) - 0.5) * (1.0 + (b - tl.floor(b)))
    w = tl.where(mask, w, 0.0)
    tl.store(out_ptr + slot * 3, tl.sum(x, axis=0))
    tl.store(out_ptr + slot * 3 + 1, tl.sum(x * x, axis=0))
    tl.store(out_ptr + slot * 3 + 2, tl.sum(x * w, axis=0))


def box_checksum(v: torch.Tensor, cols: int, row0: int, col0: int, chunk: int, phi: float) -> torch.Tensor:
    """[3] float64: rollout.checksums.box_checksum of the CUDA box ``v`` [h, w]; ``chunk`` a power of 2."""
    h, w = v.shape
    if v.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=v.device)
    if v.device not in _phi:
        _phi[v.device] = torch.tensor([phi], dtype=torch.float64, device=v.device)
    shift = chunk.bit_length() - 1
    assert chunk == 1 << shift, chunk
    start = row0 * cols + col0
    if w == cols or h == 1:  # whole rows (or one row): one run of flat indices
        x = v.reshape(-1).contiguous()
        blocks = triton.cdiv(x.numel(), _BLOCK)
        partial = torch.empty(blocks, 3, dtype=torch.float64, device=v.device)
        _box_kernel[(blocks,)](
            x, partial, _phi[v.device], x.numel(), 0, start, cols, SHIFT=shift, BLOCK=_BLOCK, FLAT=True
        )
    else:
        v = v if v.stride(1) == 1 else v.contiguous()
        col_blocks = triton.cdiv(w, _BLOCK)
        partial = torch.empty(h * col_blocks, 3, dtype=torch.float64, device=v.device)
        _box_kernel[(h, col_blocks)](
            v, partial, _phi[v.device], w, v.stride(0), start, cols, SHIFT=shift, BLOCK=_BLOCK, FLAT=False
        )
    return partial.sum(0)
