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
    parking = HostParking(torch.device("cpu"))

    freed = parking.park("state", [base, view, other])
    freed += parking.park("grads", [grads], keep_values=False)
    assert freed == (24 + 5 + 8) * 4  # the shared storage counts once
    assert base.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0

    parking.reload()
    assert torch.equal(base, expect_base) and torch.equal(view, expect_base[2:4])
    assert torch.equal(other, expect_other)
    assert torch.equal(grads, torch.zeros(8)), "values not kept come back as zeros"
    view.add_(1.0)  # still a view of the restored storage
    assert torch.equal(base[2:4], expect_base[2:4] + 1.0)
    assert parking.parked_bytes == 0


def test_host_buffers_are_reused_across_steps():
    t = torch.randn(16)
    parking = HostParking(torch.device("cpu"))
    parking.park("x", [t])
    first = parking._host[("x", 0)]
    parking.reload()
    t.mul_(2.0)
    expect = t.clone()
    parking.park("x", [t])
    assert parking._host[("x", 0)] is first
    parking.reload()
    assert torch.equal(t, expect)
