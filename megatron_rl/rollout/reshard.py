"""The reshard stream: the actor's Megatron shards (any TP x PP x DP) -> full HF tensors -> engine.

This is the only path by which weights reach a rollout engine. Everything about names and layouts
comes from :mod:`megatron_rl.weights.tables` (``ParamLayout``) and
:func:`megatron_rl.weights.hf_io.scatter_shard`; this module only moves bytes.

Pipeline (identical on every rank, driven by a plan computed from the tables alone):

1. **Plan.** Walk the actor's parameters in global model order (stage 0's embedding and layers,
   ..., the last stage's final norm and LM head). Each Megatron parameter produces one or more HF
   tensors (``linear_qkv`` -> q/k/v, ``linear_fc1`` -> gate/up, phi3's fused tensors stay fused).
   Pack them greedily into buckets of at most ``bucket_bytes`` in the engine dtype; a bucket never
   spans two pipeline stages, and a parameter whose HF tensors alone exceed the limit forms a
   bucket of its own. Inside a bucket, each MoE layer's routed experts are laid out projection by
   projection (every expert's gate and up, then every expert's down), so that one view per layer and
   projection (:class:`ExpertStack`) holds them in the layout of an engine's fused expert weights.
   Tied embeddings: the HF ``lm_head`` is not sent (neither is Megatron's copy
   of the embedding on the last stage); the engine ties it to ``embed_tokens``.
2. **TP gather** (owning stage only). The local shards of the bucket's TP-split parameters are
   packed into one flat send buffer and gathered with ONE ``all_gather_into_tensor`` over the TP
   group: recv[r] holds rank r's shards back to back. Replicated parameters (norms, the router) are
   not gathered.
2b. **Expert gather** (mixture-of-experts buckets, owning stage only). A routed expert lives on one
   EP rank (EP rank r holds experts [r*E/EP, (r+1)*E/EP)), split over its expert-TP group. Each rank
   packs its shards of the bucket's experts that it owns, and ONE all-gather over the expert
   model-parallel group (ETP x EP ranks) gives every rank every expert of the bucket: recv[g] holds
   group rank g's shards, padded to the largest rank's share. HF names are the checkpoint's, one
   tensor per expert (``mlp.experts.{e}.gate_proj.weight``: what SGLang loads; the transformers
   engine maps them onto its fused ``mlp.experts.gate_up_proj`` / ``down_proj``,
   :func:`megatron_rl.weights.tables.module_param_views`).
3. **Scatter.** For each parameter and TP rank r, ``scatter_shard`` copies shard r's pieces into
   the full HF tensors, which are views into the flat bucket buffer; the copy also casts to the
   engine dtype. Vocabulary padding rows are dropped here.
4. **PP broadcast.** The filled bucket is broadcast over the pipeline group from its owning stage,
   so every rank (each TP rank of each stage) ends up with the same full bucket on its device.
5. **Hand over.** The bucket (a list of ``(hf_name, tensor)`` with the flat buffer as ``.flat``)
   is yielded to the engine, which loads it before asking for the next one; the buffers are reused
   for the next bucket and freed at the end.

Peak extra memory per rank: one bucket buffer (engine dtype), plus on the owning stage the TP
send buffer (this rank's shards of one bucket) and the gather buffer (TP x that, or ETP x EP x the
largest rank's expert shards of a bucket). The whole model is never materialised on one device. DP
replicas run the same stream independently (with EP > 1 the expert gather spans DP replicas: EP
ranks are carved out of the data-parallel ones).

Integrity (:func:`sync_weights`, always on). As each bucket is handed over, the stream records a
checksum of every tensor in it (``rollout.checksums``: three float64 reductions per tensor on the
device, sum, sum of squares and a sum weighted by position, so that a permuted or swapped copy
differs too). After ``engine.update_weights`` the engine reads its own copy of the same tensors back
(``engine.weight_checksums``) and the two are compared on every rank where an engine holds weights
(``engine.checks_weights``); one all-reduce makes every rank agree on the first mismatch, and all
raise :class:`WeightSyncError` naming the bucket, the tensor and the rank. An engine that cannot
read its weights back does not set ``checks_weights`` (docs/reliability.md, Sync integrity).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.errors import LaunchError
from megatron_rl.model_args import ModelArgs
from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.bucket_plan import (
    Bucket,
    BucketPlan,
    ExpertStack,
    ParamSlot,
    make_bucket,
    plan_buckets,
)
from megatron_rl.rollout.checksums import first_mismatch, tensor_checksum
from megatron_rl.weights.hf_io import scatter_shard
from megatron_rl.weights.tables import ParamLayout


class WeightSyncError(LaunchError):
    """The engine does not hold the weights the actor streamed; the message names bucket, tensor, rank."""


StreamFault = Callable[[int, int, "Bucket"], bool]
"""A test's fault in the weight stream: called as ``(sync, index, bucket)`` for every bucket of this
process's ``sync``-th weight sync (1-based) before its checksums are taken; it may change the bucket in
place (a layout bug: the checksums then agree with the wrong weights) and returns True to drop it before
the engine sees it (a lost bucket: the checksums still cover it)."""

stream_fault: StreamFault | None = None
"""Set by tests only (tests/distributed/workers); None on every production run."""

_syncs = 0  # weight syncs of this process (the ``sync`` a stream fault sees)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (the one carrying ``args`` and ``role``)."""
    while not hasattr(model, "args") and isinstance(inner := getattr(model, "module", None), nn.Module):
        model = inner  # a DDP / Float16Module wrapper's .module is the Module it wraps
    if not hasattr(model, "args"):
        raise TypeError("expected a model from megatron_rl.models.builder.build_model (it has .args/.role)")
    return model


def _all_gather_flat(recv: torch.Tensor, send: torch.Tensor, ps: ParallelState, group=None) -> None:
    """recv[r * S:(r + 1) * S] = rank r's send, in one collective over ``group`` (default: TP)."""
    group = ps.tp_group if group is None else group
    if ps.backend == "nccl":
        dist.all_gather_into_tensor(recv, send, group=group)
    else:  # gloo: the list form, with the outputs as views of recv (no extra copy)
        dist.all_gather(list(recv.view(dist.get_world_size(group), -1).unbind(0)), send, group=group)


def _shard_shape(lay: ParamLayout, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one TP (or expert-TP) shard of a parameter whose first HF tensor is ``hf_shape``."""
    if lay.dim == 0:
        return (lay.shard_rows, *hf_shape[1:])
    if lay.dim == 1:
        return (hf_shape[0], lay.shard_rows)
    return hf_shape


class _ExpertGather:
    """The expert half of a bucket (step 2b of the module docstring): who owns which expert, and
    where each rank's shards sit in the gather buffer."""

    def __init__(self, args: ModelArgs, ps: ParallelState) -> None:
        from megatron.core import parallel_state as mps

        ps.check_current()
        self.group = mps.get_expert_tensor_and_model_parallel_group()
        self.per_ep = args.num_experts // ps.ep_size
        self.ep_rank, self.size = ps.ep_rank, dist.get_world_size(self.group)
        # (ep_rank, etp_rank) of every rank of the group, in group order: [ETP x EP, 2]
        me = torch.tensor([ps.ep_rank, ps.etp_rank], dtype=torch.int64, device=ps.device)
        coords = torch.empty(self.size * 2, dtype=torch.int64, device=ps.device)
        _all_gather_flat(coords, me, ps, self.group)
        self.coords = [tuple(c) for c in coords.view(self.size, 2).tolist()]

    def owner(self, lay: ParamLayout) -> int:
        assert lay.expert is not None  # callers ask only about an expert's layout
        return lay.expert // self.per_ep

    def owned(self, b: BucketPlan, ep_rank: int) -> list[ParamSlot]:
        return [s for s in b.params if s.layout.expert is not None and self.owner(s.layout) == ep_rank]

    def shard_numel(self, s: ParamSlot) -> int:
        return math.prod(_shard_shape(s.layout, s.tensors[0].shape))

    def per_rank(self, b: BucketPlan) -> int:
        """Elements each group rank sends for bucket ``b`` (the largest EP rank's share)."""
        owners = {self.owner(s.layout) for s in b.params if s.layout.expert is not None}
        return max((sum(self.shard_numel(s) for s in self.owned(b, r)) for r in owners), default=0)


@torch.no_grad()
def iter_hf_buckets(
    model: nn.Module, ps: ParallelState, bucket_bytes: int, dtype: torch.dtype
) -> Iterator[Bucket]:
    """Collective generator of HF-named full tensors in ``dtype``, ``bucket_bytes`` at a time.

    Every rank of the world must iterate it to the end. Each yielded bucket is valid until the
    next one is requested (the buffers are reused).
    """
    model = unwrap(model)
    if model.role != "actor":
        raise ValueError(f"only the actor's weights go to the rollout engine, got role={model.role!r}")
    args = model.args
    assert isinstance(args, ModelArgs), type(args)  # build_model keeps its ModelArgs on the model
    tp, pp = ps.tp_size, ps.pp_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    etp = ps.etp_size if args.is_moe else None
    plan = plan_buckets(args, tp, pp, bucket_bytes, itemsize, etp, getattr(model, "stage_layers", None))
    from megatron_rl.models.builder import named_global_params
    from megatron_rl.models.lora import merged_params

    params = named_global_params(model)  # iter_hf_buckets runs under no_grad: no detach needed
    values = merged_params(model, params)  # LoRA: what the engine runs, W + scale * B @ A
    mine = [b for b in plan if b.stage == ps.pp_rank]
    experts = _ExpertGather(args, ps) if args.is_moe else None
    # GroupedExperts: an expert's weights are slices of one [E_local, rows, cols] tensor per projection
    # (LoRA on the experts: each expert's merged weight is read one by one instead)
    grouped = not getattr(values, "experts_adapted", False) and any(
        v._base is not None and v._base.dim() == 3 for n, v in params.items() if ".local_experts." in n
    )

    def held(lay: ParamLayout) -> bool:  # an expert's parameters live on its EP rank only
        if lay.expert is None:
            return True
        assert experts is not None  # expert layouts come only from MoE models, which have an _ExpertGather
        return experts.owner(lay) == ps.ep_rank

    missing = [
        s.layout.name for b in mine for s in b.params if held(s.layout) and s.layout.name not in params
    ]
    if missing:
        raise KeyError(
            f"the actor on stage {ps.pp_rank} lacks parameters {missing[:5]} (model/table mismatch)"
        )

    def gathered(b: BucketPlan) -> list[ParamSlot]:
        return [s for s in b.params if tp > 1 and s.layout.dim is not None and s.layout.expert is None]

    send_cap = max((sum(params[s.layout.name].numel() for s in gathered(b)) for b in mine), default=0)
    if experts is not None:
        send_cap = max([send_cap, *(experts.per_rank(b) for b in mine)])
    group_size = max(tp, experts.size if experts is not None else 1)
    wdtype = next(iter(params.values())).dtype
    send = torch.empty(send_cap, dtype=wdtype, device=ps.device)  # this rank's shards of a bucket
    # [tp, S] (or [ETP x EP, S] for experts): every rank's shards
    recv = torch.empty(group_size * send_cap, dtype=wdtype, device=ps.device)
    flat = torch.empty(max(b.numel for b in plan), dtype=dtype, device=ps.device)  # one bucket

    for b in plan:
        bucket = make_bucket(b, flat)
        views = dict(bucket)
        if b.stage == ps.pp_rank:
            split = gathered(b)
            if split:
                shards = [values[s.layout.name] for s in split]
                total = sum(p.numel() for p in shards)
                torch.cat([p.reshape(-1) for p in shards], out=send[:total])
                _all_gather_flat(recv[: tp * total], send[:total], ps)
                off = 0
                for s, p in zip(split, shards, strict=True):
                    for r in range(tp):
                        start = r * total + off
                        scatter_shard(s.layout, r, recv[start : start + p.numel()].view(p.shape), views)
                    off += p.numel()
            if experts is not None and any(s.layout.expert is not None for s in b.params):
                if not (grouped and _gather_expert_stacks(b, experts, params, send, recv, flat, ps)):
                    _gather_experts(b, experts, values, send, recv, views, ps)
            for s in b.params:
                if s.layout.expert is None and not (tp > 1 and s.layout.dim is not None):
                    scatter_shard(s.layout, 0, values[s.layout.name], views)  # replicated or TP=1
        if pp > 1:
            dist.broadcast(flat[: b.numel], src=dist.get_global_rank(ps.pp_group, b.stage), group=ps.pp_group)
        yield bucket
    del send, recv, flat


def _gather_expert_stacks(
    b: BucketPlan,
    experts: _ExpertGather,
    params: dict[str, torch.Tensor],
    send: torch.Tensor,
    recv: torch.Tensor,
    flat: torch.Tensor,
    ps: ParallelState,
) -> bool:
    """Step 2b by stacked runs, where each expert is whole on its EP rank (expert TP 1) and held by
    GroupedExperts: a run of an EP rank's experts is then a slice of its stacked weight, in the HF
    layout of the bucket's :class:`ExpertStack` (fc1 = [gate; up] rows, fc2 = down). Each rank packs
    one slice per stack, one all-gather, and one copy per stack and EP rank lands the runs in the
    bucket: no per-expert copy. False (nothing done) at expert TP > 1, or where the bucket's stacks do
    not hold all its experts; the same on every rank of the expert group."""
    in_stacks = sum(len(st.names) for st in b.stacks)
    if ps.etp_size != 1 or in_stacks != sum(len(s.tensors) for s in b.params if s.layout.expert is not None):
        return False
    fc = {"w13": "linear_fc1", "w2": "linear_fc2"}
    # per stack: the stacked weight's slice of each EP rank's run, [(ep_rank, first, count)] in EP order
    runs = []
    for st in b.stacks:
        owners: dict[int, list[int]] = {}
        for e in range(st.first, st.first + st.shape[0]):
            owners.setdefault(e // experts.per_ep, []).append(e)
        runs.append([(r, es[0], len(es)) for r, es in sorted(owners.items())])

    def mine(st: ExpertStack, first: int, n: int) -> torch.Tensor:
        base = params[
            f"decoder.layers.{st.layer}.mlp.experts.local_experts.{first}.{fc[st.proj]}.weight"
        ]._base
        assert base is not None  # GroupedExperts' weights are views of the stacked one (``grouped``)
        j = first - experts.ep_rank * experts.per_ep
        return base[j : j + n]

    slices = [
        mine(st, first, n)
        for st, run in zip(b.stacks, runs, strict=True)
        for r, first, n in run
        if r == experts.ep_rank
    ]
    per_expert = [math.prod(st.shape[1:]) for st in b.stacks]
    if experts.size == 1:  # every expert is here (EP 1): straight from the stacked weights
        for st, x in zip(b.stacks, slices, strict=True):
            flat[st.offset : st.offset + st.numel].copy_(x.reshape(-1))
        return True
    # every rank sends the same number of elements (the largest rank's share): recv[g] is rank g's
    sizes = {
        r: sum(n * k for run, k in zip(runs, per_expert, strict=True) for rr, _, n in run if rr == r)
        for r in range(ps.ep_size)
    }
    per_rank = max(sizes.values())
    total = sizes[experts.ep_rank]
    if slices:
        torch.cat([x.reshape(-1) for x in slices], out=send[:total])
    _all_gather_flat(recv[: experts.size * per_rank], send[:per_rank], ps, experts.group)
    for g, (ep_rank, _) in enumerate(experts.coords):
        off = g * per_rank
        for st, run, k in zip(b.stacks, runs, per_expert, strict=True):
            for r, first, n in run:
                if r == ep_rank:
                    start = st.offset + (first - st.first) * k
                    flat[start : start + n * k].copy_(recv[off : off + n * k])
                    off += n * k
    return True


def _gather_experts(
    b: BucketPlan,
    experts: _ExpertGather,
    params: Mapping[str, torch.Tensor],
    send: torch.Tensor,
    recv: torch.Tensor,
    views: dict[str, torch.Tensor],
    ps: ParallelState,
) -> None:
    """Step 2b for bucket ``b``: one all-gather over the expert model-parallel group, then each
    expert's shards scattered into its HF tensors (a no-op for a bucket without experts)."""
    per_rank = experts.per_rank(b)
    if per_rank == 0:
        return
    own = experts.owned(b, experts.ep_rank)
    total = sum(experts.shard_numel(s) for s in own)
    if own:
        torch.cat([params[s.layout.name].reshape(-1) for s in own], out=send[:total])
    _all_gather_flat(recv[: experts.size * per_rank], send[:per_rank], ps, experts.group)
    for g, (ep_rank, etp_rank) in enumerate(experts.coords):
        off = g * per_rank
        for s in experts.owned(b, ep_rank):
            n = experts.shard_numel(s)
            shard = recv[off : off + n].view(_shard_shape(s.layout, s.tensors[0].shape))
            scatter_shard(s.layout, etp_rank, shard, views)
            off += n


def sync_weights(
    model: nn.Module, ps: ParallelState, engine, bucket_megabytes: int, dtype: torch.dtype | None = None
) -> dict[str, float]:
    """Stream the actor into ``engine`` (collective) and check the engine's copy (module docstring).
    Returns bytes sent, buckets, seconds (check_seconds: the integrity check's share). LoRA unmerged
    (``lora.merge=false``): the base once, then the adapters alone (rollout.lora_sync)."""
    from megatron_rl.rollout.lora_sync import sync_adapters, unmerged

    def weights() -> dict[str, float]:
        return stream_weights(model, ps, engine, bucket_megabytes, dtype)

    if unmerged(unwrap(model), engine):
        return sync_adapters(unwrap(model), ps, engine, dtype, weights)
    return weights()


def stream_weights(
    model: nn.Module, ps: ParallelState, engine, bucket_megabytes: int, dtype: torch.dtype | None = None
) -> dict[str, float]:
    """The weight stream of :func:`sync_weights` (every weight the model's forward uses: LoRA merged),
    its integrity checked."""
    global _syncs
    _syncs += 1
    dtype = dtype or engine.dtype
    stats = {"bytes": 0.0, "buckets": 0.0}
    finished = False
    fault, sync_number = stream_fault, _syncs
    # (bucket index, name, numel, [CHECKSUM_SIZE] checksum) of every tensor streamed; the checksum only
    # where an engine holds weights to compare with (engine.checks_weights)
    sent: list[tuple[int, str, int, torch.Tensor | None]] = []
    compare = bool(getattr(engine, "checks_weights", False))
    check_seconds = 0.0

    def stream() -> Iterator[Bucket]:
        nonlocal finished, check_seconds
        for i, bucket in enumerate(iter_hf_buckets(model, ps, int(bucket_megabytes * 2**20), dtype)):
            stats["buckets"] += 1
            stats["bytes"] += bucket.flat.numel() * bucket.flat.element_size()
            drop = fault is not None and fault(sync_number, i, bucket)
            t0 = time.perf_counter()
            sent.extend((i, name, t.numel(), tensor_checksum(t) if compare else None) for name, t in bucket)
            check_seconds += time.perf_counter() - t0
            if drop:
                continue
            yield bucket
        finished = True

    start = time.perf_counter()
    with torch.no_grad():
        engine.update_weights(stream())
    if not finished:
        raise RuntimeError(
            f"{type(engine).__name__}.update_weights returned before the end of the weight stream; it is "
            "collective and must exhaust the bucket iterator on every rank"
        )
    t0 = time.perf_counter()
    check_weights(engine, ps, sent)
    check_seconds += time.perf_counter() - t0
    if ps.device.type == "cuda":
        torch.cuda.synchronize()
    stats["seconds"] = time.perf_counter() - start
    stats["check_seconds"] = check_seconds
    return stats


def check_weights(engine, ps: ParallelState, sent: list[tuple[int, str, int, torch.Tensor | None]]) -> None:
    """Collective: compare the stream's checksums with the engine's copy; WeightSyncError on every rank
    at the first tensor (in stream order) that differs on any rank. Engines that hold weights on this
    rank say so with ``checks_weights`` and give ``weight_checksums(names)``: {name: [CHECKSUM_SIZE]
    float64}, the ``tensor_checksum`` of their copy (a name they lack is left out: a mismatch, unless
    it is in the engine's ``unreadable``, the names it holds but cannot read back)."""
    compare = bool(getattr(engine, "checks_weights", False))
    got = engine.weight_checksums([name for _, name, _, _ in sent]) if compare else None
    n = len(sent)
    first = n  # index into ``sent`` of this rank's first mismatch (n: none)
    if got is not None and n:
        sums: list[torch.Tensor] = []
        for _, _, _, c in sent:
            assert c is not None  # sync_weights checksums every tensor for an engine that checks weights
            sums.append(c)
        want = torch.stack(sums).to(ps.device)  # [n, CHECKSUM_SIZE]
        numel = torch.tensor([k for _, _, k, _ in sent], device=ps.device)
        unread = getattr(engine, "unreadable", ())
        bad = first_mismatch([name for _, name, _, _ in sent], want, got, numel, unread)
        first = n if bad is None else bad
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    code = torch.tensor([first * world + rank], dtype=torch.int64, device=ps.device)  # first, then rank
    if world > 1:
        dist.all_reduce(code, op=dist.ReduceOp.MIN)
    first, bad_rank = divmod(int(code.item()), world)
    if first >= n:
        return
    bucket, name, _, _ = sent[first]
    raise WeightSyncError(
        f"weight sync check failed: the rollout engine on rank {bad_rank} does not hold {name} (bucket "
        f"{bucket + 1} of {sent[-1][0] + 1}) as the actor streamed it, so it would generate from another "
        "policy; look for a weight-stream or engine-loading bug (docs/reliability.md, Sync integrity).",
        same_on_all_ranks=True,
    )
