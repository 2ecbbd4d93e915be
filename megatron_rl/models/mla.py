"""Multi-latent attention's down projections, whole on every tensor-parallel rank.

models.builder puts :class:`DuplicatedLinear` (through :func:`duplicated_linear`) in megatron-core's MLA
spec for ``linear_q_down_proj`` and ``linear_kv_down_proj``; the weight tables lay them out replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DuplicatedLinear(nn.Module):
    """A linear held whole by every TP rank (megatron's "duplicated" parallel mode): multi-latent
    attention's down projections, [s(/TP), b, H] -> [s(/TP), b, out] on this rank's tokens.

    megatron-core's MLA takes such a linear (Transformer Engine's, otherwise none) or a column-parallel
    one; with the column-parallel one it all-gathers the latent over TP and uses the rotary key part
    as it is on every rank, so that part's gradient, which each rank holds only for its own heads, is
    split instead of summed: the layers below get a wrong gradient at TP > 1. With this linear MLA
    gathers the rotary key along the sequence instead, whose backward sums over TP. Under sequence
    parallelism each rank sees 1/TP of the tokens, so the weight's gradient is a partial sum: marked
    ``sequence_parallel``, megatron's finalize_model_grads sums it over TP."""

    def __init__(self, input_size: int, output_size: int, *, config, bias: bool = False, **_) -> None:
        super().__init__()
        if bias:
            raise ValueError("DuplicatedLinear holds no bias")
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel
        # megatron's mark for finalize_model_grads (torch's Parameter stub has no such attribute)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        self.tp_group = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint({"weight": self.weight}, prefix, {}, sharded_offsets)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself."""


def duplicated_linear():
    """The class megatron's MLA builds its down projections from in "duplicated" mode: its Transformer
    Engine linear when TE is there, else :class:`DuplicatedLinear` in that role."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not (getattr(mla, "HAVE_TE", False) and isinstance(mla.TELinear, type)):  # no TE (or a stand-in)
        mla.TELinear = DuplicatedLinear
    return mla.TELinear
