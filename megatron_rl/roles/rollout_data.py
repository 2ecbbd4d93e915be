"""The separate rollout's generations (``roles.remote_rollout``) over a process group: the leader of
each engine sends every training rank only the rows of its own DP rank; the job's store carries one
small message per engine and request.

    generations group   the training ranks (0..T-1), then the rollout ranks (T..T+R-1), built on the
                        job's store (``roles.bridge.Bridge``) at the first weights request, where
                        every rank of both roles meets (an engine's sends wait for no receive)
    routes              engine j generates rows ``slice_bounds(B, engines)[j]`` of the training DP
                        ranks' prompts concatenated in DP order; each overlap of DP rank p's prompts
                        and slice j is a ``roles.bridge.Route`` (``row_routes``)
    store message       ``res/<tag>/<j>`` (:func:`header`): the engine's seconds, each generation's
                        length, finish reason and (multi-turn) info dict, which fields follow; no
                        tensors, no token ids
    bulk, per route     engine j's leader --> every training rank of DP rank p, the route's rows'
                        generations (each prompt's n in order) as flat tensors (:data:`FIELDS`):
                          token_ids      int32 [sum of lengths]
                          logprobs       float64 [sum of lengths] (when the engine returned them)
                          response_mask  int8 [sum of lengths] (multi-turn episodes)
                          routed_experts int16 [sum of routed rows, L, k] (routing replay)

An engine posts its sends and goes on to the next request; a training rank receives the generations of
the requests in the order they were posted (``RolloutClient``), which is the order every engine sends
them in, so a pair's messages match on NCCL (order) as on gloo (tags). A field of no elements is not
sent (both sides know the lengths from the message).
"""

from __future__ import annotations

import itertools

import torch

from megatron_rl.roles.bridge import Bridge, Layout, Route
from megatron_rl.roles.transport import Mailbox
from megatron_rl.rollout.base import Generation

FIELDS = {
    "token_ids": torch.int32,
    "logprobs": torch.float64,  # the engine's values unrounded: the colocated loop keeps them as floats
    "response_mask": torch.int8,
    "routed_experts": torch.int16,
}
"""The generations' bulk fields and their dtypes on the group."""

TAGS = {f: i for i, f in enumerate(FIELDS)}

GROUP = "rollout/gens-group"
"""The generations group's keys in the job's store."""


def _present(gens: list[Generation], field: str) -> bool:
    have = {getattr(g, field) is not None for g in gens}
    if len(have) > 1:  # one request's generations come from one engine call
        raise RuntimeError(f"the engine returned {field} for some generations of one request but not all")
    return have == {True}


def header(gens: list[list[Generation]], seconds: float) -> dict:
    """The store message of one engine's generations: the host-side things and the lengths."""
    flat = [g for per in gens for g in per]
    routed = _present(flat, "routed_experts")
    return {
        "seconds": seconds,
        "n": [len(per) for per in gens],  # generations of each prompt, in the slice's order
        "lengths": [len(g.token_ids) for g in flat],
        "finish": [g.finish_reason for g in flat],
        "info": [g.info for g in flat],
        "fields": [f for f in FIELDS if f != "token_ids" and _present(flat, f)],
        "routed_rows": [g.routed_experts.shape[0] for g in flat] if routed else None,  # type: ignore[union-attr]
        "routed_shape": list(flat[0].routed_experts.shape[1:]) if routed else None,  # type: ignore[union-attr]
    }


def _flat(gens: list[Generation], field: str, device: torch.device) -> torch.Tensor:
    if field == "routed_experts":
        return torch.cat([g.routed_experts for g in gens]).to(device)  # type: ignore[misc]
    return torch.tensor([x for g in gens for x in getattr(g, field)], dtype=FIELDS[field], device=device)


def _span(msg: dict, rows: tuple[int, int]) -> tuple[int, int]:
    """The generations (indices into the message's flat lists) of prompts ``rows`` of the slice."""
    return sum(msg["n"][: rows[0]]), sum(msg["n"][: rows[1]])


def send_generations(
    bridge: Bridge,
    gens: list[list[Generation]],
    msg: dict,
    engine: int,
    routes: list[Route],
    training: Layout,
) -> None:
    """An engine's leader: post the sends of its slice's generations (``gens``, one list per prompt;
    ``msg``: their :func:`header`), each route's rows to every training rank of the route's DP rank."""
    flat = [g for per in gens for g in per]
    for route in routes:
        if route.dp != engine:
            continue
        a, b = _span(msg, route.slice_rows)
        for f in ["token_ids", *msg["fields"]]:
            t = _flat(flat[a:b], f, bridge.ps.device)
            if t.numel() == 0:
                continue
            for rank in training.ranks_of(route.part):
                bridge.send(t, rank, to_first=True, tag=f)


def recv_generations(bridge: Bridge, msg: dict, route: Route, engine_leader: int) -> list[list[Generation]]:
    """A training rank: its rows of one engine's generations (``route``: its DP rank's overlap with the
    engine's slice; ``msg``: the engine's :func:`header`), one list per prompt."""
    a, b = _span(msg, route.slice_rows)
    lengths = msg["lengths"][a:b]
    total = sum(lengths)
    got: dict[str, list] = {}
    for f in ["token_ids", *msg["fields"]]:
        if f == "routed_experts":
            rows = msg["routed_rows"][a:b]
            shape: tuple[int, ...] = (sum(rows), *msg["routed_shape"])
        else:
            shape = (total,)
        t = (
            bridge.recv(shape, FIELDS[f], engine_leader, from_first=False, tag=f)
            if shape[0] > 0
            else torch.empty(shape, dtype=FIELDS[f], device=bridge.ps.device)
        )
        if f == "routed_experts":
            got[f] = list(t.cpu().split(rows))
        else:
            values = t.cpu().tolist()
            ends = list(itertools.accumulate(lengths))
            got[f] = [values[e - n : e] for e, n in zip(ends, lengths, strict=True)]
    flat = [
        Generation(
            got["token_ids"][i],
            got["logprobs"][i] if "logprobs" in got else None,
            msg["finish"][a + i],
            got["response_mask"][i] if "response_mask" in got else None,
            msg["info"][a + i],
            got["routed_experts"][i] if "routed_experts" in got else None,
        )
        for i in range(b - a)
    ]
    counts = msg["n"][route.slice_rows[0] : route.slice_rows[1]]
    out, k = [], 0
    for n in counts:
        out.append(flat[k : k + n])
        k += n
    return out


def receive_rows(bridge: Bridge, box: Mailbox, msg: dict, route: Route) -> list[list[Generation]]:
    """:func:`recv_generations` from the engine leader the message names; a failure of the group
    raises the cause a rollout rank that left put in the store (``Mailbox.raise_if_peer_left``)."""
    with box.peer_cause():
        return recv_generations(bridge, msg, route, msg["leader"])
