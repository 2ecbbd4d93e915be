"""Training state parked in host memory while the colocated rollout engine generates.

During generation the trainer needs none of its optimizer states, fp32 master weights, gradient
buckets, nor the critic's and the reference's weights (nor the actor's once they are synced), while
the engine wants the GPU for its weights and KV cache. :class:`HostParking` moves such tensors'
storage to pinned host memory and frees it on the device, in place: the tensor objects (parameters,
views into gradient buckets, AdamW's state) stay valid and see their values again after
:meth:`HostParking.reload`. Storages whose contents need not survive (gradients, re-zeroed before
every update) are freed without a copy and come back as zeros.

Host buffers are allocated once (the first park) and reused, so a step pays two PCIe copies of the
parked bytes and no allocation. The torch allocator keeps freed blocks cached; the caller empties the
cache before the engine takes the memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (copies whatever views share it, at once)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostParking:
    """Park tensors' device storage in host memory and bring it back (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: dict[tuple[str, int], torch.Tensor] = {}
        self._parked: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []

    @property
    def parked_bytes(self) -> int:
        return sum(n for _, n, _ in self._parked)

    def park(self, name: str, tensors: Iterable[torch.Tensor], keep_values: bool = True) -> int:
        """Free the device storage of ``tensors`` (those on this device), keeping a host copy unless
        ``keep_values`` is False. ``name`` identifies the set across steps (host buffers are reused).
        Returns the bytes freed."""
        storages, seen = [], set()
        for t in tensors:
            if t is None or t.device != self.device:
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                storages.append(st)
        pin = self.device.type == "cuda"
        parked = []
        for i, st in enumerate(storages):
            n, host = st.nbytes(), None
            if keep_values:
                host = self._host.get((name, i))
                if host is None or host.numel() != n:
                    host = self._host[(name, i)] = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes_view(st), non_blocking=pin)
            parked.append((st, n, host))
        if pin:
            torch.cuda.synchronize(self.device)  # the copies must land before the storage is freed
        for st, _, _ in parked:
            st.resize_(0)
        self._parked += parked
        return sum(n for _, n, _ in parked)

    def reload(self) -> None:
        """Give every parked storage its device memory and contents back."""
        for st, n, host in self._parked:
            st.resize_(n)
            view = _bytes_view(st)
            if host is None:
                view.zero_()
            else:
                view.copy_(host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host buffers are reused by the next park
        self._parked = []
