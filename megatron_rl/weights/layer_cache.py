"""The layer cache behind the Megatron checkpoint readers (:class:`~megatron_rl.weights.legacy.LegacyReader`,
:class:`~megatron_rl.weights.torch_dist.TorchDistReader`): HF tensors produced one read unit at a time."""

from __future__ import annotations

import torch

from megatron_rl.model_args import ModelArgs
from megatron_rl.weights.tables import ParamLayout, Piece


class LayerCachedReader:
    """``HFReader``'s interface over a Megatron checkpoint: HF tensors are produced one read unit (a
    layer, or a non-layer tensor) at a time and cached until a tensor of another unit is asked for.

    Subclasses fill ``_producer`` (HF name -> the Megatron layout that produces it) and define
    ``_group_of`` (the read unit of a layout) and ``_produce`` (HF tensors of that unit).
    """

    args: ModelArgs
    path: str

    def _init_cache(self) -> None:
        self._producer: dict[str, ParamLayout] = {}
        self._cache: dict[str, torch.Tensor] = {}
        self._cache_group: object = "empty"
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._producer)

    def get(self, name: str) -> torch.Tensor:
        lay = self._producer.get(name)
        if lay is None:
            raise KeyError(f"Tensor {name!r} is not part of the {self.args.arch} model in {self.path}")
        group = self._group_of(lay)
        if group != self._cache_group:
            self._cache, self._cache_group = {}, group
        if name not in self._cache:
            self._cache.update(self._produce(lay, group))
        return self._cache[name]

    def read(self, piece: Piece, dim: int | None) -> torch.Tensor:
        full = self.get(piece.hf_name)
        return full[:, piece.start : piece.stop] if dim == 1 else full[piece.start : piece.stop]

    def _group_of(self, lay: ParamLayout) -> object:
        raise NotImplementedError

    def _produce(self, lay: ParamLayout, group: object) -> dict[str, torch.Tensor]:
        raise NotImplementedError
