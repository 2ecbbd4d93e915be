"""What the Megatron checkpoint readers and writers share: the HF-tensor source interface, the shape
of a TP shard, the padded vocabulary, pipeline stage offsets."""

from __future__ import annotations

from typing import Protocol

import torch

from megatron_rl.weights.tables import ParamLayout, Piece

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


class TensorSource(Protocol):
    """HF tensors by name, or by :class:`Piece` (rows, or columns for ``dim == 1``): ``HFReader``,
    :class:`LegacyReader`, :class:`TorchDistReader`."""

    def keys(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def read(self, piece: Piece, dim: int | None) -> torch.Tensor: ...


def fit_vocab(layout: ParamLayout, shard_rows: int, vocab_size: int) -> ParamLayout:
    """The same vocabulary layout for another padding: shard r holds rows [r*n, (r+1)*n) of the padded
    vocabulary, of which only rows < ``vocab_size`` exist in HF (Megatron-LM pads to 128 x TP)."""
    if layout.shard_rows == shard_rows:
        return layout
    name = layout.pieces[0][0].hf_name
    tp = len(layout.pieces)
    if shard_rows * tp < vocab_size:
        raise ValueError(
            f"{layout.name}: checkpoint holds {shard_rows * tp} vocabulary rows, the model config says "
            f"{vocab_size}; the config.json does not belong to this checkpoint"
        )
    pieces = tuple(
        (Piece(name, r * shard_rows, min((r + 1) * shard_rows, vocab_size)),)
        if r * shard_rows < vocab_size
        else ()
        for r in range(tp)
    )
    return ParamLayout(layout.name, layout.dim, shard_rows, pieces)


def shard_shape(layout: ParamLayout, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of one TP shard of a Megatron parameter (HF shapes give the other dimension)."""
    full = shapes[next(pc.hf_name for rank in layout.pieces for pc in rank)]
    if layout.dim is None:
        return full
    if layout.dim == 1:  # row-parallel [out, in / TP]
        return (full[0], layout.shard_rows)
    return (layout.shard_rows, *full[1:])


def stage_offsets(layers_per_stage: list[int]) -> list[int]:
    offsets = [0]
    for n in layers_per_stage:
        offsets.append(offsets[-1] + n)
    return offsets
