"""The weight stream's bucket plan: which HF tensors travel together, and where each lies in a bucket's
flat buffer (a pure function of the weight tables; :mod:`megatron_rl.rollout.reshard` moves the bytes).

Buckets are filled greedily in table order up to ``bucket_bytes``; a bucket never spans two pipeline
stages; tensors an engine must load in one call stay in one bucket (:func:`_units`); inside a bucket each
MoE layer's routed experts are laid out projection by projection (:class:`ExpertStack`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_rl.model_args import ModelArgs
from megatron_rl.weights import tables
from megatron_rl.weights.hf_io import hf_names
from megatron_rl.weights.tables import ParamLayout


@dataclass(frozen=True)
class HFSlot:
    """One full HF tensor inside a bucket buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    """Element offset in the bucket's flat buffer."""
    fp32: bool = False
    """Travels in float32 whatever the bucket's dtype (sigmoid routing's expert-score bias: rounded to
    bf16 it would route other tokens than the trainer's), over ``span`` elements of the buffer."""
    span: int = 0
    """Elements of the flat buffer the tensor covers (its numel unless ``fp32`` in a narrower dtype)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamSlot:
    """A Megatron parameter and the HF tensors it fills."""

    layout: ParamLayout
    tensors: tuple[HFSlot, ...]


@dataclass(frozen=True)
class ExpertStack:
    """Consecutive experts of one MoE layer whose HF tensors of one projection lie back to back in a
    bucket, so that one view covers them in the layout of an engine's fused expert weights:
    ``w13`` [count, 2F, H] (each expert's gate rows, then its up rows) or ``w2`` [count, H, F]."""

    layer: int
    proj: str
    """``w13`` (gate and up) or ``w2`` (down)."""
    first: int
    """Global index of the first expert."""
    offset: int
    """Element offset in the bucket's flat buffer."""
    shape: tuple[int, int, int]
    names: tuple[str, ...]
    """The per-expert HF tensors the view covers, in buffer order."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketPlan:
    stage: int
    """Pipeline stage that owns (gathers and broadcasts) every parameter of this bucket."""
    params: tuple[ParamSlot, ...]
    numel: int
    """Elements of the bucket (sum of its HF tensors)."""
    stacks: tuple[ExpertStack, ...] = ()
    """The bucket's experts as stacked views (every routed expert of the bucket is in one)."""


class Bucket(list):
    """A list of ``(hf_name, tensor)``; ``flat`` is the 1-D buffer all the tensors are views of
    (engines that ship one tensor per bucket, like SGLang's flattened format, use it); ``stacks`` the
    bucket's routed experts as ``(ExpertStack, view)``, views of the same buffer."""

    flat: torch.Tensor
    stacks: list[tuple[ExpertStack, torch.Tensor]]


def make_bucket(b: BucketPlan, flat: torch.Tensor) -> Bucket:
    """Bucket ``b``'s tensors as views of ``flat`` (its buffer, at least ``b.numel`` long)."""
    bucket = Bucket((t.name, _slot_view(flat, t)) for s in b.params for t in s.tensors)
    bucket.flat = flat[: b.numel]
    bucket.stacks = [(st, flat[st.offset : st.offset + st.numel].view(st.shape)) for st in b.stacks]
    return bucket


def _slot_view(flat: torch.Tensor, t: HFSlot) -> torch.Tensor:
    if not t.fp32:
        return flat[t.offset : t.offset + t.numel].view(t.shape)
    return flat[t.offset : t.offset + t.span].view(torch.float32).view(t.shape)


def plan_buckets(
    args: ModelArgs,
    tp: int,
    pp: int,
    bucket_bytes: int,
    itemsize: int,
    etp: int | None = None,
    stage_layers: Sequence[int] | None = None,
) -> list[BucketPlan]:
    """The bucket plan of the actor at TP x PP (a pure function of the tables). Every expert of a
    mixture-of-experts model is in it, whatever EP; ``etp`` (expert TP, default TP) only changes how
    an expert's shards map onto its HF tensors, not the buckets; ``stage_layers``: an uneven pipeline's
    decoder layers per stage, or an interleaved one's per virtual stage (PP x VPP of them, in model
    order; a bucket's ``stage`` is then the pipeline rank holding the chunk: virtual stage % PP)."""
    if bucket_bytes <= 0:
        raise ValueError(
            f"bucket size {bucket_bytes} bytes must be > 0 "
            "(actor_rollout_ref.rollout.update_weights_bucket_megabytes)"
        )
    shapes = tables.hf_shapes(args)
    plan: list[BucketPlan] = []
    stages = len(stage_layers) if stage_layers else pp  # virtual stages (interleaved) or stages
    for virtual in range(stages):
        stage = virtual % pp  # the pipeline rank that holds it
        pending: list[tuple[ParamLayout, list[str]]] = []
        used = 0
        layouts = tables.iter_stage_layouts(
            args, tp, stages, virtual, "actor", etp=etp, stage_layers=stage_layers
        )
        # tied: the last stage's copy of the embedding is not sent (HF ties lm_head itself)
        tied = args.tie_embeddings
        for unit in _units(lay for lay in layouts if not (tied and lay.name.startswith("output_layer"))):
            entries = [(lay, hf_names(lay)) for lay in unit]
            size = sum(math.prod(shapes[x]) for _, names in entries for x in names)
            if pending and (used + size) * itemsize > bucket_bytes:
                plan.append(_place(stage, pending, shapes, itemsize))
                pending, used = [], 0
            pending += entries
            used += size
        if pending:
            plan.append(_place(stage, pending, shapes, itemsize))
    return plan


def _place(
    stage: int, pending: list[tuple[ParamLayout, list[str]]], shapes: dict, itemsize: int = 4
) -> BucketPlan:
    """Lay a bucket's HF tensors out in its flat buffer: in table order, except that each MoE layer's
    routed experts are grouped at the place of its first expert parameter, every expert's gate and
    up (fc1) first, then every expert's down (fc2), experts ascending. Each projection's run is then
    one [experts, rows, cols] view (:class:`ExpertStack`): what a fused-experts engine loads at once.
    A float32 tensor (``ParamLayout.fp32``) in a buffer of ``itemsize`` < 4 takes 4 / itemsize
    elements per value, aligned to 4 bytes."""
    wide = max(1, 4 // itemsize)  # buffer elements per float32 value
    first_of_layer: dict[int, int] = {}

    def order(i: int) -> tuple[int, int, int]:
        lay = pending[i][0]
        if lay.expert is None:
            return (i, 0, 0)
        block = first_of_layer.setdefault(_layer(lay), i)
        return (block, int(".linear_fc2." in lay.name), lay.expert)

    offsets: dict[str, int] = {}
    spans: dict[str, int] = {}
    used = 0
    for i in sorted(range(len(pending)), key=order):
        fp32 = pending[i][0].fp32
        for x in pending[i][1]:
            if fp32:
                used = -(-used // wide) * wide
            offsets[x], spans[x] = used, math.prod(shapes[x]) * (wide if fp32 else 1)
            used += spans[x]
    slots = tuple(
        ParamSlot(lay, tuple(HFSlot(x, tuple(shapes[x]), offsets[x], lay.fp32, spans[x]) for x in names))
        for lay, names in pending
    )
    stacks = []
    for layer in first_of_layer:
        for proj, fc in (("w13", ".linear_fc1."), ("w2", ".linear_fc2.")):
            run = sorted(
                (s for s in slots if s.layout.expert is not None and fc in s.layout.name),
                key=lambda s: _expert(s.layout),
            )
            run = [s for s in run if tables.layer_index(s.layout.name) == layer]
            if not run or len(run[0].tensors) != (2 if proj == "w13" else 1):
                continue
            rows, cols = run[0].tensors[0].shape
            per_expert = (2 * rows, cols) if proj == "w13" else (rows, cols)
            names = tuple(t.name for s in run for t in s.tensors)
            stacks.append(
                ExpertStack(
                    layer,
                    proj,
                    _expert(run[0].layout),
                    run[0].tensors[0].offset,
                    (len(run), *per_expert),
                    names,
                )
            )
    return BucketPlan(stage, slots, used, tuple(stacks))


def _layer(lay: ParamLayout) -> int:
    i = tables.layer_index(lay.name)
    assert i is not None, lay.name  # an expert's parameter is in a decoder layer
    return i


def _expert(lay: ParamLayout) -> int:
    assert lay.expert is not None, lay.name
    return lay.expert


_HOLD = (".linear_q_down_proj.weight", ".q_layernorm.weight", ".linear_q_up_proj.weight")
"""Layouts that wait for the next one in their bucket: SGLang fuses an MLA layer's q_a_proj and
kv_a_proj_with_mqa into one weight within a single load call, so q_down ... kv_down travel together."""


def _units(layouts: Iterable[ParamLayout]) -> Iterator[list[ParamLayout]]:
    """The layouts in order, grouped into what must share a bucket (one layout, or an MLA layer's
    query down projection through its key-value down projection)."""
    unit: list[ParamLayout] = []
    for lay in layouts:
        unit.append(lay)
        if not lay.name.endswith(_HOLD):
            yield unit
            unit = []
    if unit:
        yield unit
