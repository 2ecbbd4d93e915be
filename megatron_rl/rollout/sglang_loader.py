"""A weight bucket into SGLang's model, routed experts copied straight into the fused expert weights.

Runs in SGLang's worker process: the engine is started with ``custom_weight_loader=[LOADER]`` and
each bucket goes to ``update_weights_from_tensor`` with ``load_format=LOADER`` as ONE named tensor,
the bucket's flat buffer (shared through a CUDA IPC handle), whose name is the JSON header
:func:`bucket_header` writes: the offset and shape of every tensor, with a layer's routed experts as
stacked runs (:class:`~megatron_rl.rollout.reshard.ExpertStack`) rather than one entry per expert.

:func:`load_bucket` copies a stacked run into ``FusedMoE.w13_weight`` / ``w2_weight`` (the slice of
this engine rank's expert TP shard) with one copy per projection, when :func:`fused_experts` finds the
layout it writes: unquantized, gated, not transposed, padded or pre-sharded, gate before up, no expert
parallelism or fused shared experts, shapes as expected. Anything else (and every other tensor) goes
through the model's own ``load_weights`` under the per-expert checkpoint names, as before: the
per-expert loader is the fallback the check selects, and both write the same bytes.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import torch

LOADER = "megatron_rl.rollout.sglang_loader.load_bucket"
"""The dotted path SGLang imports (server argument ``custom_weight_loader``, and the load format)."""

logger = logging.getLogger(__name__)
_reported: set[str] = set()  # the path each projection took, logged once per process


def bucket_header(bucket) -> str:
    """JSON: ``tensors`` [[name, shape, offset]] for the tensors outside expert stacks, ``stacks``
    [[layer, proj, first, shape, offset, names]]; offsets in elements of ``bucket.flat``."""
    flat = bucket.flat
    base, size = flat.data_ptr(), flat.element_size()

    def offset(t: torch.Tensor) -> int:
        return (t.data_ptr() - base) // size

    stacks = getattr(bucket, "stacks", [])
    covered = {n for st, _ in stacks for n in st.names}
    return json.dumps(
        {
            "tensors": [[n, list(t.shape), offset(t)] for n, t in bucket if n not in covered],
            "stacks": [
                [st.layer, st.proj, st.first, list(st.shape), offset(v), list(st.names)] for st, v in stacks
            ],
        }
    )


def _view(flat: torch.Tensor, offset: int, shape: list[int]) -> torch.Tensor:
    return flat[offset : offset + math.prod(shape)].view(shape)


def load_bucket(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: ``named_tensors`` is ``[(header, flat)]``."""
    ((header, flat),) = named_tensors
    h = json.loads(header)
    rest = [(name, _view(flat, off, shape)) for name, shape, off in h["tensors"]]
    for layer, proj, first, shape, off, names in h["stacks"]:
        stack = _view(flat, off, shape)
        experts = fused_experts(model, layer, proj, first, stack)
        _report(proj, experts is not None)
        if experts is None:
            rest += unstack(proj, stack, names)
        else:
            copy_stack(experts, proj, first, stack)
    if rest:
        model.load_weights(rest)


def unstack(proj: str, stack: torch.Tensor, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """A stacked run back into per-expert checkpoint tensors (views): w13 [n, 2F, H] -> gate_e, up_e."""
    if proj == "w2":
        return list(zip(names, stack.unbind(0), strict=True))
    f = stack.shape[1] // 2
    parts = [t for e in stack.unbind(0) for t in (e[:f], e[f:])]
    return list(zip(names, parts, strict=True))


def fused_experts(model: Any, layer: int, proj: str, first: int, stack: torch.Tensor) -> Any | None:
    """The layer's FusedMoE if a stacked run can be copied into its weights as-is, else None."""
    try:
        experts = model.model.layers[layer].mlp.experts
    except (AttributeError, IndexError, TypeError):
        return None
    w13, w2 = getattr(experts, "w13_weight", None), getattr(experts, "w2_weight", None)
    method = getattr(experts, "quant_method", None)
    runner = getattr(experts, "moe_runner_config", None)
    plain = (
        isinstance(w13, torch.Tensor)
        and isinstance(w2, torch.Tensor)
        and type(method).__name__ == "UnquantizedFusedMoEMethod"
        and not getattr(method, "load_up_proj_weight_first", False)
        and bool(getattr(runner, "is_gated", False))
        and not getattr(experts, "use_triton_kernels", False)  # a transposed layout
        and not getattr(experts, "use_padded_loading", False)
        and not getattr(experts, "use_presharded_weights", False)
        and getattr(experts, "num_fused_shared_experts", 0) == 0
        and getattr(experts, "moe_ep_size", None) == 1
    )
    if not plain:
        return None
    tp = getattr(experts, "moe_tp_size", 0)
    n, rows, cols = stack.shape
    e_total = w13.shape[0]
    if tp < 1 or first + n > e_total or w2.shape[0] != e_total or stack.dtype != w13.dtype:
        return None
    hidden, ffn = (cols, rows // 2) if proj == "w13" else (rows, cols)
    if (
        ffn % tp
        or tuple(w13.shape[1:]) != (2 * ffn // tp, hidden)
        or tuple(w2.shape[1:]) != (hidden, ffn // tp)
    ):
        return None
    return experts


@torch.no_grad()
def copy_stack(experts: Any, proj: str, first: int, stack: torch.Tensor) -> None:
    """Experts [first, first + n) of ``stack`` into this rank's expert-TP slice of the fused weights:
    w13[e] = [gate_e rows of the slice; up_e rows of the slice], w2[e] = down_e columns of the slice."""
    n = stack.shape[0]
    tp, r = experts.moe_tp_size, experts.moe_tp_rank
    if proj == "w13":
        f = stack.shape[1] // 2
        s = f // tp
        w = experts.w13_weight.data[first : first + n]
        w[:, :s].copy_(stack[:, r * s : (r + 1) * s])
        w[:, s:].copy_(stack[:, f + r * s : f + (r + 1) * s])
    else:
        s = stack.shape[2] // tp
        experts.w2_weight.data[first : first + n].copy_(stack[:, :, r * s : (r + 1) * s])


def _report(proj: str, direct: bool) -> None:
    if proj not in _reported:
        _reported.add(proj)
        how = "copied into the fused expert weights" if direct else "loaded expert by expert"
        logger.info("megatron-rl: %s expert weights %s", proj, how)
