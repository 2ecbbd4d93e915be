"""Point-to-point bulk tensors between two roles on ranks of their own: a process group over both roles'
ranks built on the job's store (``transport.bridge_group``), each side's ranks named by their rank in
their own world, and the rows each pair shares.

    Bridge      this rank's end: the first role's ranks are 0..F-1 of the group, the second's F..F+S-1;
                sends are posted at once (their Work kept, waited later), receives wait
    Layout      one side's DP rank and DP-leader flag of each of its ranks
    Route       the rows that a part of the sender's rows (a DP rank's) and a contiguous slice of the
                receiver's share (:func:`row_routes`)

The critic's data (``roles.critic_data``: actor -> critic) and the separate rollout's generations
(``roles.rollout_data``: engines -> training ranks) travel this way; the store carries their requests.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.parallel import ParallelState
from megatron_rl.roles.transport import bridge_group, slice_bounds


@dataclass(frozen=True)
class Route:
    """The rows that part ``part`` (a DP rank's rows) and slice ``dp`` share: ``part_rows`` [start, end)
    within the part, ``slice_rows`` the same rows within the slice."""

    part: int
    dp: int
    part_rows: tuple[int, int]
    slice_rows: tuple[int, int]


def row_routes(part_rows: list[int], slices: int) -> list[Route]:
    """Every (part, slice) overlap of ``part_rows`` rows per part (in DP order) and ``slices`` contiguous
    slices of them (``slice_bounds``); ordered by slice, then part."""
    starts = [sum(part_rows[:p]) for p in range(len(part_rows))]
    out = []
    for j, (a, b) in enumerate(slice_bounds(sum(part_rows), slices)):
        for p, (s, n) in enumerate(zip(starts, part_rows, strict=True)):
            lo, hi = max(a, s), min(b, s + n)
            if lo < hi:
                out.append(Route(p, j, (lo - s, hi - s), (lo - a, hi - a)))
    return out


@dataclass(frozen=True)
class Layout:
    """One side's ranks (in its own world): each rank's DP rank, and whether it is its DP replica's
    leader (tp_rank 0, pp_rank 0: the rank that sends its replica's rows)."""

    dp_of_rank: tuple[int, ...]
    leaders: tuple[bool, ...]

    @classmethod
    def gather(cls, ps: ParallelState) -> Layout:
        """Collective over ``ps``'s world."""
        mine = torch.tensor([ps.dp_rank, int(ps.is_dp_leader)], dtype=torch.int64, device=ps.device)
        every = [torch.zeros_like(mine) for _ in range(ps.world_size)]
        dist.all_gather(every, mine)
        return cls(tuple(int(t[0]) for t in every), tuple(bool(t[1]) for t in every))

    def ranks_of(self, dp: int) -> list[int]:
        return [r for r, d in enumerate(self.dp_of_rank) if d == dp]

    def leader_of(self, dp: int) -> int:
        return next(r for r, d in enumerate(self.dp_of_rank) if d == dp and self.leaders[r])

    def as_message(self) -> dict:
        return {"dp_of_rank": list(self.dp_of_rank), "leaders": list(self.leaders)}

    @classmethod
    def of_message(cls, msg: dict) -> Layout:
        return cls(tuple(msg["dp_of_rank"]), tuple(msg["leaders"]))


class Bridge:
    """This rank's end of a bridge group ``name`` (its keys in the job's store): point-to-point sends and
    receives between a rank of the first role (``first=True``) and a rank of the second, each named by
    its rank in its own world; ``tags`` names the messages (gloo matches on them, NCCL on order)."""

    def __init__(
        self,
        ps: ParallelState,
        store: dist.Store,
        name: str,
        worlds: tuple[int, int],
        first: bool,
        timeout: datetime.timedelta,
        tags: dict[str, int],
    ) -> None:
        self.ps, self.first_world, self.tags = ps, worlds[0], tags
        me = ps.rank if first else worlds[0] + ps.rank
        self.group = bridge_group(store, name, me, sum(worlds), ps.backend, timeout)
        self.works: list = []
        self._keep: list[torch.Tensor] = []  # the tensors of sends in flight

    def _peer(self, rank: int, of_first: bool) -> int:
        return rank if of_first else self.first_world + rank

    def send(self, tensor: torch.Tensor, rank: int, to_first: bool, tag: str) -> None:
        t = tensor.contiguous()
        self._keep.append(t)
        self.works.append(self.group.send([t], self._peer(rank, to_first), self.tags[tag]))

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, rank: int, from_first: bool, tag: str
    ) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.ps.device)
        self.group.recv([t], self._peer(rank, from_first), self.tags[tag]).wait()
        return t

    def wait_sends(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self._keep = [], []

    def forget_sent(self) -> None:
        """Drop the sends that completed (a sender that runs ahead keeps only those in flight)."""
        live = [(w, t) for w, t in zip(self.works, self._keep, strict=True) if not w.is_completed()]
        self.works, self._keep = [w for w, _ in live], [t for _, t in live]
