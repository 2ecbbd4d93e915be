"""Training state parked in host memory while the colocated rollout engine generates.

During generation the trainer needs none of its optimizer states, fp32 master weights, gradient
buckets, nor the critic's and the reference's weights (nor the actor's once they are synced), while
the engine wants the GPU for its weights and KV cache. :class:`HostParking` moves such tensors'
storage to pinned host memory and frees it on the device, in place: the tensor objects (parameters,
views into gradient buckets, AdamW's state) stay valid and see their values again after
:meth:`HostParking.reload`. Storages whose contents need not survive (gradients, re-zeroed before
every update) are freed without a copy and come back as zeros.

Host memory comes in pinned slabs of a power-of-two size, handed out back to back (a storage may
span two slabs): torch's pinned allocator rounds every request up to a power of two, which would
cost up to 2x the parked bytes with one buffer per tensor. The slabs are allocated by the first park
and reused, in the same order, by every later one; a step pays two PCIe copies of the parked bytes.
The torch allocator keeps freed device blocks cached; the caller empties the cache before the engine
takes the memory. What is parked is decided once per run by run/memory_plan.py (the *_offload keys,
``auto`` by default: only what would not fit beside the engine).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (copies whatever views share it, at once)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


SLAB_BYTES = 1 << 28  # 256 MiB


class _HostSlabs:
    """Pinned host memory in slabs of ``slab_bytes``, handed out as consecutive byte ranges."""

    def __init__(self, slab_bytes: int, pin: bool) -> None:
        self.slab_bytes, self.pin = slab_bytes, pin
        self.slabs: list[torch.Tensor] = []
        self.used = 0

    def take(self, n: int) -> list[torch.Tensor]:
        """The next ``n`` bytes, as uint8 views of one or more slabs."""
        pieces = []
        while n:
            i, off = divmod(self.used, self.slab_bytes)
            if i == len(self.slabs):
                self.slabs.append(torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin))
            k = min(n, self.slab_bytes - off)
            pieces.append(self.slabs[i][off : off + k])
            self.used += k
            n -= k
        return pieces


class HostParking:
    """Park tensors' device storage in host memory and bring it back (see the module docstring)."""

    def __init__(self, device: torch.device, slab_bytes: int = SLAB_BYTES) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # tensors report their index
        self.device = device
        self._pin = device.type == "cuda"
        self._host = _HostSlabs(slab_bytes, self._pin)
        self._parked: list[tuple[torch.UntypedStorage, int, list[torch.Tensor]]] = []
        self.last_parked_bytes = 0
        """Bytes the last park-reload cycle held off the device (the perf/parked_gb metric)."""

    @property
    def parked_bytes(self) -> int:
        return sum(n for _, n, _ in self._parked)

    @property
    def host_bytes(self) -> int:
        """Host memory held for parking (allocated by the first park, kept for the next)."""
        return len(self._host.slabs) * self._host.slab_bytes

    def park(self, tensors: Iterable[torch.Tensor], keep_values: bool = True) -> int:
        """Free the device storage of ``tensors`` (those on this device), keeping a host copy unless
        ``keep_values`` is False. Returns the bytes freed."""
        storages, seen = [], set()
        for t in tensors:
            if t is None or t.device != self.device:
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                storages.append(st)
        parked = []
        for st in storages:
            n, pieces = st.nbytes(), []
            if keep_values:
                pieces, src, off = self._host.take(n), _bytes_view(st), 0
                for piece in pieces:
                    piece.copy_(src[off : off + piece.numel()], non_blocking=self._pin)
                    off += piece.numel()
            parked.append((st, n, pieces))
        if self._pin:
            torch.cuda.synchronize(self.device)  # the copies must land before the storage is freed
        for st, _, _ in parked:
            st.resize_(0)
        self._parked += parked
        return sum(n for _, n, _ in parked)

    def reload(self) -> None:
        """Give every parked storage its device memory and contents back."""
        for st, n, pieces in self._parked:
            st.resize_(n)
            dst, off = _bytes_view(st), 0
            if not pieces:
                dst.zero_()
            for piece in pieces:
                dst[off : off + piece.numel()].copy_(piece, non_blocking=self._pin)
                off += piece.numel()
        if self._pin:
            torch.cuda.synchronize(self.device)  # the slabs are reused by the next park
        self.last_parked_bytes = self.parked_bytes
        self._parked = []
        self._host.used = 0
