"""The project's own layers inside megatron-core's layer specs (models/builder.py puts them there):
core attention through torch's fused kernels (padded rows, or packed sequences: models/packing.py),
torch's RMSNorm behind megatron's norm signature, and the critic's value head (the reward model's score
head)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernels of packed segments. Ragged sequences give every micro-batch new segment lengths, and
# cuDNN's attention (torch's first choice on Hopper with cuDNN >= 9.15) builds an execution plan for
# each new shape and layout before it runs; flash and memory-efficient attention run any length as it
# comes. Math is the fallback where neither applies (fp32 on CPU, say). Padded rows keep torch's choice.
PACKED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class SDPAttention(nn.Module):
    """Core attention through ``F.scaled_dot_product_attention``; same math as megatron's unfused
    DotProductAttention (softmax(QK^T / sqrt(d)) V with the explicit boolean mask), fused kernels."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **_,
    ):
        if packed_seq_params is not None:
            return self._segments(query, key, value, packed_seq_params.bounds)
        # query [s, b, heads, d], key/value [s, b, kv_groups, d] -> [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        # megatron masks are True where attention is NOT allowed; SDPA's bool mask is the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _segments(self, query, key, value, bounds: tuple[int, ...]) -> torch.Tensor:
        """Packed sequences (models/packing.py): query [T, heads, d], key/value [T, kv_groups, d], each
        segment ``bounds[i]:bounds[i + 1]`` causal on its own -> [T, heads * d_v]. One fused call per
        segment length (PACKED_BACKENDS): no mask, no attention across segments, no padding."""
        groups, order = _length_groups(bounds, query.device)
        with sdpa_kernel(PACKED_BACKENDS):
            outs = [self._group(query, key, value, *group) for group in groups]
        out = torch.cat(outs)  # [T, heads * d_v] in the groups' token order
        return out if order is None else out[order]

    def _group(self, query, key, value, length: int, starts: tuple[int, ...], index) -> torch.Tensor:
        """The segments of one length -> [n * L, heads * d_v] (``index``: their token positions)."""
        if len(starts) == 1:  # a view of the segment: [1, L, heads, d]
            q, k, v = (x[None, starts[0] : starts[0] + length] for x in (query, key, value))
        else:  # the segments of this length side by side: [n, L, heads, d]
            q, k, v = (x[index].view(len(starts), length, *x.shape[1:]) for x in (query, key, value))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )  # [n, heads, L, d_v]
        return o.transpose(1, 2).reshape(-1, o.shape[1] * o.shape[3])


@functools.lru_cache(maxsize=8)
def _length_groups(
    bounds: tuple[int, ...], device: torch.device
) -> tuple[tuple[tuple[int, tuple[int, ...], torch.Tensor], ...], torch.Tensor | None]:
    """Packed segments grouped by length: ((L, segment starts, their token positions [n * L]), ...) in
    order of first appearance, and the permutation that takes the groups' concatenated tokens back to
    packed order (None: already in it), as index tensors on ``device``. Cached: every layer of a pass
    asks for the same bounds, and a host-to-device copy per layer would stall the GPU's queue."""
    by_length: dict[int, list[int]] = {}
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        by_length.setdefault(stop - start, []).append(start)
    positions = [
        (torch.tensor(starts)[:, None] + torch.arange(length)[None]).flatten()
        for length, starts in by_length.items()
    ]
    tokens = torch.cat(positions)
    in_order = bool((tokens == torch.arange(len(tokens))).all())
    groups = tuple(
        (length, tuple(starts), index.to(device))
        for (length, starts), index in zip(by_length.items(), positions, strict=True)
    )
    return groups, None if in_order else tokens.argsort().to(device)


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm behind megatron's norm signature, usable with sequence parallelism.

    Under sequence parallelism each TP rank normalises 1/TP of the tokens, so its weight gradient is a
    partial sum: the ``sequence_parallel`` mark makes megatron's ``finalize_model_grads`` sum it over
    TP (megatron's own torch-norm wrapper refuses sequence parallelism for want of that mark).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_) -> None:
        # params_dtype like every other weight: megatron's mixed-precision optimizer (and its checkpoint
        # of fp32 masters) expects a bf16/fp16 model to hold no fp32 parameters.
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron reads this mark


class ValueHead(nn.Module):
    """hidden [s, b, H] -> values [s, b, 1]; replicated over TP (its input is identical there).

    Under sequence parallelism the input is [s/TP, b, H]: it is gathered first, so that every TP rank
    computes the same values and the same (full) weight gradient. ``bias=False`` is the reward model's
    score head: HF's ``...ForSequenceClassification.score`` is ``nn.Linear(H, 1, bias=False)``."""

    def __init__(
        self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False, bias: bool = True
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # backward keeps this rank's slice of a gradient that is already complete on every rank
            hidden_states = gather_from_sequence_parallel_region(hidden_states, False)
        return F.linear(hidden_states, self.weight, self.bias), None
