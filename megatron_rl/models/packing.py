"""Padding-free passes (``*.megatron.use_remove_padding``): a micro-batch's sequences packed into one
row, megatron-core's THD layout.

    micro-batch  input_ids, attention_mask [b, s]   each row's real tokens contiguous (left-padded
                                                    prompt, right-padded response, or compacted)
      -> :func:`pack`  ids [1, T]                   the real tokens of every row, row after row;
                                                    T = their count, rounded up to the sequence
                                                    multiple (TP under sequence parallelism) by one
                                                    more segment of filler tokens
                       params                       cu_seqlens [n + 1] of the segments (int32, on the
                                                    device for TE's fused RoPE; as Python ints for
                                                    the core attention's loop)
                       index [b, s]                 the packed position of every (row, column); a
                                                    padding column points at some real token
      -> GPTModel      hidden [T(/TP), 1, h]        RoPE restarts at each segment (megatron's THD
                                                    RoPE); attention stays inside each segment
                                                    (layers.SDPAttention, causal per segment)
      -> output_positions gathers the head's rows through ``index``: the model returns [b, r, k]
                       as the padded pass does, so every loss and collector reads it unchanged.

No padding token reaches attention, the MLP or the LM head: a micro-batch costs its real tokens only
(the padded pass costs rows x its longest sequence), and the token budget of dynamic batching counts
real tokens (microbatches.py). The outputs at padding columns are a real token's, and every caller
masks them as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedSegments(PackedSeqParams):
    """megatron-core's THD parameters plus the segment bounds as Python ints."""

    bounds: tuple[int, ...] = ()
    """cu_seqlens as Python ints: the core attention loops over the segments without a device sync."""


@dataclass(frozen=True)
class Packed:
    """One micro-batch in the THD layout (see the module docstring)."""

    ids: torch.Tensor
    """[1, T] token ids: each row's real tokens in row order, then filler tokens up to the multiple."""
    params: PackedSegments
    index: torch.Tensor
    """[b, s] long: the packed position of each column of the micro-batch."""
    keep: torch.Tensor
    """[b, s] bool: the micro-batch's real tokens (the rows of :attr:`ids`, in order)."""

    @property
    def tokens(self) -> int:
        """T: packed positions, fillers included."""
        return self.ids.shape[1]

    def positions(self, where: slice | torch.Tensor | None) -> torch.Tensor:
        """Micro-batch positions (a slice of columns, per-row columns [b, r], or None: all) -> their
        packed positions [b, r]."""
        if where is None:
            return self.index
        if isinstance(where, slice):
            return self.index[:, where]
        return self.index.gather(1, where.to(self.index.device))

    def rows(self, x: torch.Tensor, fill: int) -> torch.Tensor:
        """A per-token tensor of the micro-batch [b, s, ...] -> [1, T, ...] in packed order, ``fill``
        on the filler positions (e.g. recorded routing for the routers)."""
        real = x[self.keep.to(x.device)]  # [n, ...]: row-major, as ids
        return F.pad(real, (0, 0) * (x.dim() - 2) + (0, self.tokens - len(real)), value=fill)[None]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int = 1) -> Packed:
    """The THD layout of a micro-batch [b, s] (each row's real tokens contiguous)."""
    keep = attention_mask.bool()
    lengths = [n for n in keep.sum(1).tolist() if n > 0]
    real = sum(lengths)
    total = max(multiple, -(-real // multiple) * multiple)
    if total > real:  # fillers: a segment of their own, so that no real token attends to them
        lengths.append(total - real)
    ids = F.pad(input_ids[keep], (0, total - real))[None]  # [1, T]
    bounds = (0, *torch.tensor(lengths).cumsum(0).tolist())
    cu = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    longest = max(lengths)
    params = PackedSegments(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        bounds=bounds,
    )
    # real tokens: their packed position; padding: the real token before it in packed order (any
    # real token would do: every caller masks the outputs at padding)
    index = (keep.flatten().long().cumsum(0).view_as(keep) - 1).clamp(min=0)
    return Packed(ids, params, index, keep)
