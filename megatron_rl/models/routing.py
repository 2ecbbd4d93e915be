"""Routing replay (``actor_rollout_ref.actor.router_replay.mode=R3``): the actor's training forwards
route every token to the experts the rollout engine chose for it.

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
                                     this TP rank's sequence chunk under sequence parallelism)
      -> megatron's TopKRouter       calls ``router_replay.get_replay_topk`` (:class:`ReplayTopK`): the
                                     engine's ids where recorded, its own top-k elsewhere; the
                                     probabilities are the router's own scores at those ids, so the
                                     router keeps its gradient (and the aux losses their inputs).

Each router also counts the tokens whose own top-k (as a set) differs from the engine's:
``rollout_corr/router_mismatch`` = those (token, layer) pairs / all recorded ones, over every rank.
With pipeline parallelism and activation recompute together, the recomputed forward of one
micro-batch would see the targets of a later one (1F1B keeps several in flight): that combination is
refused in the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

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


def enable_replay(model: nn.Module) -> list[ReplayTopK]:
    """Put a :class:`ReplayTopK` on every router of ``model`` (this rank's stage; DDP-wrapped or not)
    and return them; ``model.routing_replay`` keeps them for :func:`set_targets`."""
    inner = getattr(model, "module", model)
    replays = []
    for layer in inner.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            router.router_replay = ReplayTopK(layer.layer_number - 1)
            replays.append(router.router_replay)
    inner.routing_replay = replays
    return replays


def replays_of(model: nn.Module) -> list[ReplayTopK]:
    return getattr(getattr(model, "module", model), "routing_replay", [])


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
