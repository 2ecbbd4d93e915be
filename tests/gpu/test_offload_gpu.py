"""HostParking on a GPU: pinned host slabs, device memory given back, values and views restored."""

import pytest
import torch

from megatron_rl.offload import HostParking

pytestmark = pytest.mark.gpu


def test_parking_frees_device_memory_and_restores_values():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    # ~0.6 GiB over storages of uneven sizes: some span two of the 64 MiB slabs.
    tensors = [torch.randn(n, device=dev, generator=g) for n in (40_000_000, 3_000_001, 123_457, 70_000_000)]
    view = tensors[0][1000:2000]
    grads = torch.ones(10_000_000, device=dev)
    expect = [t.clone().cpu() for t in tensors]
    parking = HostParking(dev, slab_bytes=1 << 26)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    freed = parking.park(tensors) + parking.park([grads], keep_values=False)
    assert freed == sum(t.numel() * 4 for t in tensors) + grads.numel() * 4
    # the caching allocator counts blocks, large ones rounded up to 2 MiB
    assert 0 <= (before - torch.cuda.memory_allocated()) - freed < 5 * (2 << 20)
    assert all(s.is_pinned() for s in parking._host.slabs)
    kept = sum(t.numel() * 4 for t in tensors)
    assert kept <= parking.host_bytes < kept + (1 << 26)  # whole slabs, no per-tensor rounding up

    parking.reload()
    assert torch.cuda.memory_allocated() == before
    for t, e in zip(tensors, expect, strict=True):
        assert torch.equal(t.cpu(), e)
    assert torch.equal(view.cpu(), expect[0][1000:2000]) and int(grads.sum()) == 0
