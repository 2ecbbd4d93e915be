"""HostParking: device storage freed and restored in place (CPU here; the same code parks to pinned
host memory on a GPU)."""

import torch

from megatron_rl.offload import HostParking


def test_park_frees_storage_and_reload_restores_views_in_place():
    base = torch.randn(6, 4)
    view = base[2:4]  # a view shares the storage: parked and restored with it
    other = torch.randn(5)
    grads = torch.full((8,), 3.0)
    expect_base, expect_other = base.clone(), other.clone()
    # 40-byte slabs: the 96-byte storage spans three of them, the 20-byte one two.
    parking = HostParking(torch.device("cpu"), slab_bytes=40)

    freed = parking.park([base, view, other])
    freed += parking.park([grads], keep_values=False)
    assert freed == (24 + 5 + 8) * 4  # the shared storage counts once
    assert base.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    assert parking.host_bytes == 3 * 40  # 116 bytes kept; the freed gradients take none

    parking.reload()
    assert torch.equal(base, expect_base) and torch.equal(view, expect_base[2:4])
    assert torch.equal(other, expect_other)
    assert torch.equal(grads, torch.zeros(8)), "values not kept come back as zeros"
    view.add_(1.0)  # still a view of the restored storage
    assert torch.equal(base[2:4], expect_base[2:4] + 1.0)
    assert parking.parked_bytes == 0


def test_host_slabs_are_reused_across_steps():
    tensors = [torch.randn(16), torch.randn(3, 7)]
    parking = HostParking(torch.device("cpu"), slab_bytes=64)
    parking.park(tensors)
    slabs = [s.data_ptr() for s in parking._host.slabs]
    parking.reload()
    for t in tensors:
        t.mul_(2.0)
    expect = [t.clone() for t in tensors]
    parking.park(tensors)
    assert [s.data_ptr() for s in parking._host.slabs] == slabs, "a later park allocated anew"
    parking.reload()
    for t, e in zip(tensors, expect, strict=True):
        assert torch.equal(t, e)
