"""The fused CUDA checksum kernel (rollout.checksum_kernel) against the torch path on the same values:
whole tensors, row and column shards, bf16 and fp32, tensors past one position-weight chunk; a swap is
still seen. Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_the_kernel_gives_the_torch_paths_checksums():
    from megatron_rl.rollout import checksums as C

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(300, 70, generator=g), torch.randn(5, C._CHECKSUM_CHUNK // 2 + 3, generator=g)]
    cases.append(torch.randn(C._CHECKSUM_CHUNK + 17, generator=g))
    for full in cases:
        for dtype in (torch.bfloat16, torch.float32):
            cpu = full.to(dtype)
            gpu = cpu.cuda()
            n = torch.tensor([cpu.numel()])
            want = C.tensor_checksum(cpu)[None]  # the torch path (CPU)
            got = C.tensor_checksum(gpu).cpu()[None]
            assert bool(C.checksums_match(want, got, n)[0]), (dtype, tuple(cpu.shape), want, got - want)
            if cpu.dim() == 2:
                rows, cols = cpu.shape
                half = rows // 2
                by_rows = C.box_checksum(gpu[:half], cols) + C.box_checksum(gpu[half:], cols, row0=half)
                cut = cols // 3
                by_cols = C.box_checksum(gpu[:, :cut], cols) + C.box_checksum(gpu[:, cut:], cols, col0=cut)
                assert bool(C.checksums_match(want, by_rows.cpu()[None], n)[0])
                assert bool(C.checksums_match(want, by_cols.cpu()[None], n)[0])
            swapped = gpu.clone().reshape(-1)
            swapped[0], swapped[7] = gpu.reshape(-1)[7], gpu.reshape(-1)[0]
            assert not bool(C.checksums_match(want, C.tensor_checksum(swapped).cpu()[None], n)[0])
