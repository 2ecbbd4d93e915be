"""The critic's data plane, when it has ranks of its own: the batch's rows, the values and the returns
travel between the actor's ranks and the critic's over a process group, each rank receiving only its
own rows and only the fields its role reads. The job's store carries the requests (``roles.critic``).

    bridge group    the actor's A ranks (0..A-1), then the critic's C ranks (A..A+C-1), built on the
                    job's store at the first batch (gloo on CPU, NCCL on GPU), like the separate
                    rollout's weights group
    layouts         each side's DP rank and DP leaders (:class:`Layout`): the critic's once, in the
                    store after its init; the actor's in every values request, with the parts' shapes
    routes          the critic's DP rank j trains rows ``slice_bounds(B, critic DP)[j]`` of the actor's
                    DP parts concatenated in DP order; each overlap of part p and slice j is a
                    :class:`Route` (p, j, its rows in p, its rows in j): :func:`row_routes`

    values request  actor DP leader of part p --> every critic rank of DP rank j, per route:
                      the route's rows of :data:`CRITIC_FIELDS` (not the log-probs, rewards, routed
                      experts or host-side metadata: the critic reads none of them)
                    critic DP leader of j --> every actor rank of part p: values [rows, R_p] float32
    update request  actor DP leader of part p --> every critic rank of DP rank j: returns and
                    response mask [rows, R_p] (rejection sampling may have masked rows since)

A critic rank pads its pieces to the widest part (prompts on the left, responses on the right, as
``RolloutBatch.concat`` pads the whole batch), so that it computes on exactly the rows and widths a
critic that received the whole batch would. Every send is posted at once (its Work waited for later), so
the actor's ranks go on with their own work while the critic receives.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.bridge import Bridge as _Bridge
from megatron_rl.roles.bridge import Layout, Route, row_routes
from megatron_rl.roles.transport import DTYPE_NAMES, DTYPES

MESSAGE_TYPES = (RolloutBatch, SeqMeta)
"""The dataclasses the critic's store messages carry (both sides' mailboxes allow these only)."""

CRITIC_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "response_mask")
"""The batch fields a critic computes values from (tokens, masks, the prompt's width)."""

RETURN_FIELDS = ("returns", "response_mask")
"""What the critic's update reads besides its own values: the advantage stage's returns and the mask."""

_TAG = {"values": 16, **{f"batch:{f}": i for i, f in enumerate(CRITIC_FIELDS)}}
_TAG.update({f"update:{f}": 32 + i for i, f in enumerate(RETURN_FIELDS)})


class Bridge(_Bridge):
    """This rank's end of the critic's bridge group: the actor's ranks first (``actor=True``), then the
    critic's (``roles.bridge.Bridge``)."""

    def __init__(
        self,
        ps: ParallelState,
        store: dist.Store,
        actor_world: int,
        critic_world: int,
        actor: bool,
        timeout: datetime.timedelta,
    ) -> None:
        super().__init__(ps, store, "critic/data-group", (actor_world, critic_world), actor, timeout, _TAG)


def dtype_names(batch: RolloutBatch, fields: tuple[str, ...]) -> dict[str, str]:
    return {f: DTYPE_NAMES[getattr(batch, f).dtype] for f in fields}


# ------------------------------------------------------------------------------------ the actor's side


def send_rows(
    bridge: Bridge, batch: RolloutBatch, part: int, routes: list[Route], critic: Layout, kind: str
) -> None:
    """Post the sends of this actor DP leader's ``part``: each route's rows of ``kind``'s fields
    ("batch": CRITIC_FIELDS; "update": RETURN_FIELDS) to every critic rank of the route's DP rank."""
    fields = CRITIC_FIELDS if kind == "batch" else RETURN_FIELDS
    for route in routes:
        if route.part != part:
            continue
        a, b = route.part_rows
        for rank in critic.ranks_of(route.dp):
            for f in fields:
                bridge.send(getattr(batch, f)[a:b], rank, to_first=False, tag=f"{kind}:{f}")


def recv_values(bridge: Bridge, part: int, width: int, routes: list[Route], critic: Layout) -> torch.Tensor:
    """This actor rank's part's values [rows, R_p], from the critic DP leaders holding its rows."""
    pieces = []
    for route in routes:
        if route.part == part:
            rows = route.part_rows[1] - route.part_rows[0]
            src = critic.leader_of(route.dp)
            pieces.append(bridge.recv((rows, width), torch.float32, src, from_first=False, tag="values"))
    return torch.cat(pieces)


# ----------------------------------------------------------------------------------- the critic's side


def recv_slice(
    bridge: Bridge, parts: list[list[int]], dtypes: dict[str, str], actor: Layout, pad_id: int
) -> RolloutBatch:
    """This critic rank's rows of the batch, padded to the widest part: ``parts`` [rows, prompt width,
    response width] of each actor DP part."""
    ps, pieces = bridge.ps, []
    for route in row_routes([p[0] for p in parts], ps.dp_size):
        if route.dp != ps.dp_rank:
            continue
        rows, p_width, r_width = (
            route.part_rows[1] - route.part_rows[0],
            parts[route.part][1],
            parts[route.part][2],
        )
        widths = {"prompts": p_width, "input_ids": p_width + r_width, "attention_mask": p_width + r_width}
        src = actor.leader_of(route.part)
        got = {
            f: bridge.recv(
                (rows, widths.get(f, r_width)), DTYPES[dtypes[f]], src, from_first=True, tag=f"batch:{f}"
            )
            for f in CRITIC_FIELDS
        }
        pieces.append(RolloutBatch(**got, meta=[SeqMeta(uid="") for _ in range(rows)]))
    # a batch of no rows at the widest part's widths: concat pads every piece to it
    p, r = max(x[1] for x in parts), max(x[2] for x in parts)
    widths = {"prompts": p, "input_ids": p + r, "attention_mask": p + r}
    empty = {
        f: torch.empty((0, widths.get(f, r)), dtype=DTYPES[dtypes[f]], device=ps.device)
        for f in CRITIC_FIELDS
    }
    return RolloutBatch.concat([RolloutBatch(**empty, meta=[]), *pieces], pad_id)


def send_values(bridge: Bridge, values: torch.Tensor, parts: list[list[int]], actor: Layout) -> None:
    """A critic DP leader: post its slice's values [b, R] to the actor ranks of each part they belong to
    (cut to that part's response width)."""
    ps = bridge.ps
    for route in row_routes([p[0] for p in parts], ps.dp_size):
        if route.dp != ps.dp_rank:
            continue
        a, b = route.slice_rows
        for rank in actor.ranks_of(route.part):
            bridge.send(values[a:b, : parts[route.part][2]], rank, to_first=True, tag="values")


def recv_returns(
    bridge: Bridge, parts: list[list[int]], width: int, dtypes: dict[str, str], actor: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """This critic rank's returns and response mask [b, R] (R: ``width``, its slice's response width),
    each part's rows right-padded with zeros (off the mask)."""
    ps = bridge.ps
    got: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for route in row_routes([p[0] for p in parts], ps.dp_size):
        if route.dp != ps.dp_rank:
            continue
        rows, r_width = route.part_rows[1] - route.part_rows[0], parts[route.part][2]
        src = actor.leader_of(route.part)
        for k, f in enumerate(RETURN_FIELDS):
            t = bridge.recv((rows, r_width), DTYPES[dtypes[f]], src, from_first=True, tag=f"update:{f}")
            got[k].append(torch.nn.functional.pad(t, (0, width - r_width)))
    return torch.cat(got[0]), torch.cat(got[1])
