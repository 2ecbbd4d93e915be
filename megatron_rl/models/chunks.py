"""Interleaved pipelines: the model chunks that one pipeline rank holds.

With ``*.megatron.virtual_pipeline_model_parallel_size`` = V > 1 each of the PP ranks builds V
megatron-core GPTModels (model chunks). Chunk v of pipeline rank p is virtual stage ``v * PP + p``:
the model's layers run through rank 0, 1, ..., PP-1 (first chunks), then again through each rank's
second chunk, and so on (megatron's interleaved 1F1B; :func:`megatron_rl.config.layout.pipeline_split`
lists the decoder layers of each virtual stage). Only virtual stage 0 holds the embedding and only the
last one the output layer.

:class:`ModelChunks` holds a rank's chunks in one module, so that parameters, buffers, ``.to()``,
``eval()`` and megatron's sharded state dict (global keys: any layout loads any other) cover them all.
The pipeline schedule (``models.forward.run_pipeline``) and DDP (``optim``) take them one by one:
:func:`chunks_of`. With V = 1 a model is one GPTModel, as before: every helper here takes both.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class ModelChunks(nn.Module):
    """A pipeline rank's model chunks (GPTModels, or their DDP wrappers), in virtual-stage order.

    Attributes set by the builder (``args``, ``role``, ``stage_layers``, ``expert_offset``) describe the
    whole model; each chunk carries its own ``layer_offset`` and ``virtual_stage``."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    @property
    def config(self):
        """The TransformerConfig that every chunk shares (megatron's schedule reads chunk 0's)."""
        return self.chunks[0].config

    def forward(self, *args, **kwargs):
        raise TypeError(
            "model chunks run one by one through the pipeline schedule (models.forward.run_pipeline)"
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """The chunks' sharded state dicts, each entry under its ``chunks.{v}.`` name (as this module's
        state_dict names it); the tensors' checkpoint keys stay the model's own, global ones (megatron
        numbers each chunk's layers from its offset), so any layout loads any other."""
        out: dict = {}
        for v, chunk in enumerate(chunks_of(self)):
            own = chunk.sharded_state_dict(prefix, sharded_offsets, metadata)
            out.update({f"{prefix}chunks.{v}.{k.removeprefix(prefix)}": sh for k, sh in own.items()})
        return out


def chunks_of(model: nn.Module) -> list[Any]:
    """The model chunks of ``model`` (a :class:`ModelChunks`): one list entry per virtual stage; any
    other model is its own one chunk."""
    return list(model.chunks) if isinstance(model, ModelChunks) else [model]


def last_chunk(model: nn.Module) -> Any:
    """The chunk that holds the output layer when this rank is the last pipeline stage."""
    return chunks_of(model)[-1]


def num_chunks(model: nn.Module) -> int:
    """Model chunks per pipeline rank (virtual_pipeline_model_parallel_size; 1 without interleaving)."""
    return len(model.chunks) if isinstance(model, ModelChunks) else 1
