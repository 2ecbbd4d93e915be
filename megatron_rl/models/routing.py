"""Routing replay (``actor_rollout_ref.actor.router_replay.mode``): the actor's training forwards route
every token to recorded experts: the rollout engine's choice (R3) or the actor's own in the old-log-prob
pass (R2).

An MoE engine and the trainer compute the router's top-k from logits that differ by rounding (other
kernels, another precision); a token near a tie goes to another expert, and its log-prob differs by
far more than rounding. Replaying the engine's choice removes that part of the mismatch. Data flow
(L decoder layers, k experts per token):

    engine (transformers: a hook on each MoE block's router; SGLang: return_routed_experts)
      -> Generation.routed_experts   [prompt + response - 1, L, k] int16: the experts of every token
                                     the engine read (the last sampled token is never read); -1 on
                                     dense layers
      -> RolloutBatch.routed_experts [B, S, L, k] aligned with input_ids; -1 where the engine routed
                                     nothing (padding, the last token)
      -> micro-batches               selected and compacted like input_ids
      -> run_pipeline's forward step: :func:`set_targets` gives each router of this pipeline stage its
                                     layer's ids in the router's token order, [s/TP * b, k] (s-major;
                                     this TP rank's sequence chunk under sequence parallelism); packed
                                     passes (models/packing.py) pack them as the tokens, [1, T, L, k]
      -> megatron's TopKRouter       calls ``router_replay.get_replay_topk`` (:class:`ReplayTopK`): the
                                     engine's ids where recorded, its own top-k elsewhere; the
                                     probabilities are the router's own scores at those ids, so the
                                     router keeps its gradient (and the aux losses their inputs).

R2 records instead: in the old-log-prob pass (forward only, before any update of the step) each router
keeps its own top-k per micro-batch ([s/TP * b, k], :class:`Recording`); the pass's micro-batch plan maps
them back to the batch's layout (gathered over TP under sequence parallelism, over PP for the layers of
other stages) as ``RolloutBatch.routed_experts``, which the updates then replay as R3 does. The updates
stay on the routing the old log-probs were computed with, whatever the optimizer steps change in the
routers; the engine's routing plays no part (multi-turn rollouts and a rollout on ranks of its own work).

Each router also counts the tokens whose own top-k (as a set) differs from the replayed one: under R3
``rollout_corr/router_mismatch`` = those (token, layer) pairs / all recorded ones, over every rank (the
engine against the trainer); under R2 ``actor/router_mismatch`` (the updated routers against the
old-log-prob pass).
With pipeline parallelism and activation recompute together, the recomputed forward of one
micro-batch would see the targets of a later one (1F1B keeps several in flight): that combination is
refused in the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

NONE = -1
"""A position with no recorded routing (padding, the last token, a dense layer)."""


class ReplayTopK:
    """Stands in for megatron-core's ``RouterReplay`` on one router (its ``get_replay_topk`` hook)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        """The global decoder layer index (0-based) of this router."""
        self.target: torch.Tensor | None = None
        """[tokens, k] expert ids for the next forward, NONE where unrecorded; None: route freely."""
        self.mismatched = torch.zeros((), dtype=torch.long)
        self.recorded = torch.zeros((), dtype=torch.long)
        self.record: list[torch.Tensor] | None = None
        """R2, during a :func:`recording`: this router's own top-k ids [tokens, k] per forward."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``scores`` [tokens, E] -> (scores at the chosen ids [tokens, k], ids [tokens, k])."""
        assert default_compute_topk is not None
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.record is not None:
            self.record.append(own.detach().to(torch.int16))
        if self.target is None:
            return values, own
        target = self.target.to(own.device, own.dtype, non_blocking=True)
        if target.shape != own.shape:
            raise RuntimeError(
                f"routing replay: layer {self.layer} got {tuple(target.shape)} recorded experts for "
                f"{tuple(own.shape)} routed ones (tokens, top-k)"
            )
        have = target[:, 0] >= 0  # [tokens]
        with torch.no_grad():
            differs = (own.sort(1).values != target.sort(1).values).any(1) & have
            self.mismatched = self.mismatched.to(own.device) + differs.sum()
            self.recorded = self.recorded.to(own.device) + have.sum()
        ids = torch.where(have[:, None], target, own)
        return scores.gather(1, ids), ids


def _inner_chunks(model: nn.Module) -> list[Any]:
    """The GPTModels of ``model``: its model chunks (interleaved pipelines) or itself, DDP unwrapped."""
    from megatron_rl.models.chunks import chunks_of

    return [getattr(c, "module", c) for c in chunks_of(getattr(model, "module", model))]


def enable_replay(model: nn.Module) -> list[ReplayTopK]:
    """Put a :class:`ReplayTopK` on every router of ``model`` (this rank's stage, all its model chunks;
    DDP-wrapped or not) and return them; each chunk's ``routing_replay`` keeps its own for
    :func:`set_targets`."""
    replays = []
    for inner in _inner_chunks(model):
        own = []
        for layer in inner.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.router_replay = ReplayTopK(layer.layer_number - 1)
                own.append(router.router_replay)
        inner.routing_replay = own
        replays += own
    return replays


def replays_of(model: nn.Module) -> list[ReplayTopK]:
    return [r for inner in _inner_chunks(model) for r in getattr(inner, "routing_replay", [])]


def set_targets(
    replays: list[ReplayTopK],
    routed: torch.Tensor | None,
    sequence_parallel: bool,
    tp_rank: int,
    tp_size: int,
) -> None:
    """Give each router its layer's recorded experts for the next forward of a micro-batch whose
    ``routed`` is [b, s, L, k] (s padded as the forward pads it); None: the routers route freely."""
    if routed is None:
        for r in replays:
            r.target = None
        return
    x = routed.transpose(0, 1)  # [s, b, L, k]: megatron's token order is s-major
    if sequence_parallel and tp_size > 1:
        chunk = x.shape[0] // tp_size
        x = x[tp_rank * chunk : (tp_rank + 1) * chunk]
    x = x.reshape(-1, *x.shape[2:])  # [s(/TP) * b, L, k]
    for r in replays:
        r.target = x[:, r.layer]


@contextlib.contextmanager
def cleared(replays: list[ReplayTopK]) -> Iterator[None]:
    """No target outlives the pass that set it (a later forward without recorded routing routes freely)."""
    try:
        yield
    finally:
        for r in replays:
            r.target = None


class Recording:
    """R2: the routing of one forward-only pass of the actor (the old-log-prob pass), per router and
    micro-batch, until :meth:`routed_experts` puts it in the batch's layout."""

    def __init__(self, replays: list[ReplayTopK], layers: int, top_k: int) -> None:
        self.replays, self.layers, self.top_k = replays, layers, top_k
        self.plan: tuple | None = None
        """(batch, micro-batches, rows of the batch per micro-batch, padding multiple, packed) of the pass."""
        self.ids: list[list[torch.Tensor]] = []
        """Per router (as ``replays``), its own top-k [tokens, k] per micro-batch, once the pass is done."""

    def routed_experts(self, ps, sequence_parallel: bool) -> torch.Tensor:
        """[B, S, L, k] int16 aligned with the batch's input_ids: the experts each real token went to,
        NONE on padding and dense layers; the same on every rank of the model (collective over TP under
        sequence parallelism and over PP)."""
        assert self.plan is not None, "routing recording: no forward pass ran"
        batch, mbs, groups, multiple, packed = self.plan
        n, width = batch.input_ids.shape
        device = batch.input_ids.device
        out = torch.full((n, width, self.layers, self.top_k), NONE, dtype=torch.int16, device=device)
        p = batch.prompts.shape[1]
        p_len = batch.attention_mask[:, :p].sum(1)  # [B] real prompt tokens (left padded)
        for m, (mb, rows) in enumerate(zip(mbs, groups, strict=True)):
            b, s = mb.input_ids.shape
            rows_t = torch.as_tensor(rows, dtype=torch.long, device=device)
            real = mb.attention_mask[: len(rows)].to(device).bool()  # [rows, s] (fillers dropped)
            if mb.response_index is None:  # the batch's own layout: column c is column c
                cols = torch.arange(s, device=device).expand(len(rows), -1)
            else:  # compacted: row j's column c came from column P - p_len + c (RolloutBatch.compacted)
                cols = (p - p_len[rows_t])[:, None] + torch.arange(s, device=device)[None]
            jj, cc = real.nonzero(as_tuple=True)
            for r, per_mb in zip(self.replays, self.ids, strict=True):
                ids = per_mb[m].to(device, torch.int32)  # [s_pad(/TP) * b, k], s-major (gloo: no int16)
                if sequence_parallel and ps.tp_size > 1:
                    parts = [torch.empty_like(ids) for _ in range(ps.tp_size)]
                    dist.all_gather(parts, ids.contiguous(), group=ps.tp_group)
                    ids = torch.cat(parts)
                if packed:  # [T, k]: the listed rows' real tokens first, row after row (models/packing.py)
                    out[rows_t[jj], cols[jj, cc], r.layer] = ids[: len(jj)].to(out.dtype)
                    continue
                ids = ids.view(-1, b, ids.shape[-1]).transpose(0, 1)[: len(rows), :s]  # [rows, s, k]
                out[rows_t[jj], cols[jj, cc], r.layer] = ids[jj, cc].to(out.dtype)
        if ps.pp_size > 1:  # each layer filled on its own stage, NONE (the minimum) elsewhere
            wide = out.to(torch.int32)  # neither gloo nor NCCL reduces int16
            dist.all_reduce(wide, op=dist.ReduceOp.MAX, group=ps.pp_group)
            out = wide.to(torch.int16)
        return out


@contextlib.contextmanager
def recording(model: nn.Module, layers: int, top_k: int) -> Iterator[Recording]:
    """R2: record the routing of the forward-only pass run inside (its micro-batch plan comes through
    :func:`planned`)."""
    inner = _inner_chunks(model)[0]  # the recording's home: the first chunk
    rec = Recording(replays_of(model), layers, top_k)
    for r in rec.replays:
        r.record = []
    inner.routing_recording = rec
    try:
        yield rec
    finally:
        rec.ids = [r.record or [] for r in rec.replays]
        for r in rec.replays:
            r.record = None
        inner.routing_recording = None


def planned(model: nn.Module, batch, microbatches: list, groups: list[list[int]], multiple: int) -> None:
    """A forward-only pass over ``batch`` is about to run these micro-batches (rows ``groups`` of it,
    padded to ``multiple``, or packed into one row each where ``model`` packs its passes): a
    :func:`recording` of ``model`` keeps the plan; otherwise nothing."""
    inner = _inner_chunks(model)[0]
    rec = getattr(inner, "routing_recording", None)
    if rec is not None:
        rec.plan = (batch, microbatches, groups, multiple, getattr(inner, "packed_sequences", False))


def mismatch_fraction(replays: list[ReplayTopK], groups=(), device=None) -> float | None:
    """The (token, layer) pairs whose own top-k differed from the engine's since the last call, summed
    over ``groups`` in turn (e.g. DP, then TP x PP: every rank of the model); None when nothing was
    recorded anywhere. Collective over ``groups`` (a stage without routers passes no replays). Resets
    the counts."""
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for r in replays:
        counts[0] += r.mismatched.to(counts.device)
        counts[1] += r.recorded.to(counts.device)
        r.mismatched = torch.zeros((), dtype=torch.long)
        r.recorded = torch.zeros((), dtype=torch.long)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    mismatched, recorded = counts.tolist()
    return mismatched / recorded if recorded else None
