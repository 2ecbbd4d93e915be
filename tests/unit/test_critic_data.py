"""The critic's data plane (roles/critic_data.py): which critic rank receives which rows, and, over a
real gloo bridge group of five processes (an actor of two DP ranks whose parts differ in rows and
widths; a critic of three ranks: DP rank 0 with a TP peer, DP rank 1), that each critic rank receives
exactly its slice of the batch as the whole batch concatenated would give it, only the fields it reads,
and that values and returns come back to the right actor ranks at their parts' widths."""

from __future__ import annotations

import os

import pytest

from megatron_rl.roles.bridge import Route, row_routes
from megatron_rl.roles.transport import slice_bounds
from tests.conftest import run_forked_ranks


@pytest.mark.parametrize(
    ("parts", "critic_dp"), [([4, 4], 2), ([4, 2], 2), ([3, 3, 3], 2), ([2, 2], 4), ([6], 3), ([1, 5], 3)]
)
def test_routes_cover_each_critic_slice_once_in_row_order(parts, critic_dp):
    routes = row_routes(parts, critic_dp)
    starts = [sum(parts[:p]) for p in range(len(parts))]
    for j, (a, b) in enumerate(slice_bounds(sum(parts), critic_dp)):
        rows = [
            starts[r.part] + k for r in routes if r.dp == j for k in range(r.part_rows[0], r.part_rows[1])
        ]
        assert rows == list(range(a, b))  # the slice's global rows, each once, in order
        within = [k for r in routes if r.dp == j for k in range(r.slice_rows[0], r.slice_rows[1])]
        assert within == list(range(b - a))


def test_a_slice_across_two_parts_takes_the_tail_of_one_and_the_head_of_the_next():
    assert row_routes([4, 2], 2) == [
        Route(part=0, dp=0, part_rows=(0, 3), slice_rows=(0, 3)),
        Route(part=0, dp=1, part_rows=(3, 4), slice_rows=(0, 1)),
        Route(part=1, dp=1, part_rows=(0, 2), slice_rows=(1, 3)),
    ]


PARTS = [[4, 4, 5], [2, 6, 3]]  # [rows, prompt width, response width] of the actor's DP parts
PAD = 0


def _part(p: int):
    """Actor DP part ``p``: random tokens (distinct per row), left-padded prompts, right-padded responses,
    and fields the critic does not read (old log-probs, routed experts)."""
    import torch

    from megatron_rl.batch import RolloutBatch, SeqMeta

    rows, pw, rw = PARTS[p]
    g = torch.Generator().manual_seed(100 + p)
    prompts = torch.randint(1, 1000, (rows, pw), generator=g)
    responses = torch.randint(1, 1000, (rows, rw), generator=g)
    pmask = torch.ones(rows, pw, dtype=torch.long)
    pmask[0, :2] = 0  # a shorter prompt
    rmask = torch.ones(rows, rw)
    rmask[-1, -1:] = 0  # a shorter response
    b = RolloutBatch.from_tokens(
        prompts, pmask, responses, rmask, [SeqMeta(uid=f"{p}-{i}") for i in range(rows)]
    )
    b.old_log_probs = torch.randn(rows, rw, generator=g)
    b.routed_experts = torch.zeros(rows, pw + rw, 2, 1, dtype=torch.int16)
    b.returns = torch.randn(rows, rw, generator=g)
    return b


def _values(batch):
    return batch.responses.float() + 0.25  # [b, R]: a function of the rows the critic holds


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_rl.batch import RolloutBatch
    from megatron_rl.parallel import ParallelState
    from megatron_rl.roles.bridge import Layout
    from megatron_rl.roles.critic_data import (
        CRITIC_FIELDS,
        Bridge,
        dtype_names,
        recv_returns,
        recv_slice,
        recv_values,
        send_rows,
        send_values,
    )

    actor_layout = Layout((0, 1), (True, True))
    critic_layout = Layout((0, 0, 1), (True, False, True))  # DP rank 0: a leader and its TP peer
    is_actor = rank < 2
    own = rank if is_actor else rank - 2
    layout = actor_layout if is_actor else critic_layout
    ps = ParallelState(
        rank=own, world_size=len(layout.dp_of_rank), local_rank=own, device=torch.device("cpu"),
        backend="gloo", tp_size=1 if is_actor else 2, pp_size=1, dp_size=2,
        tp_rank=0 if (is_actor or own != 1) else 1, pp_rank=0, dp_rank=layout.dp_of_rank[own],
        tp_group=None, pp_group=None, dp_group=None, mp_group=None, embedding_group=None,
    )  # fmt: skip
    store = dist.FileStore(init_file, 5)
    bridge = Bridge(ps, store, 2, 3, is_actor, datetime.timedelta(seconds=50))
    parts = [_part(p) for p in range(2)]
    full = RolloutBatch.concat(parts, PAD)  # the oracle: the whole batch as one critic would get it
    routes = row_routes([p[0] for p in PARTS], 2)
    if is_actor:
        mine = parts[ps.dp_rank]
        send_rows(bridge, mine, ps.dp_rank, routes, critic_layout, "batch")
        values = recv_values(bridge, ps.dp_rank, PARTS[ps.dp_rank][2], routes, critic_layout)
        first = sum(p[0] for p in PARTS[: ps.dp_rank])
        want = _values(full)[first : first + len(mine), : mine.response_length]
        assert torch.equal(values, want), (values, want)
        send_rows(bridge, mine, ps.dp_rank, routes, critic_layout, "update")
    else:
        got = recv_slice(bridge, PARTS, dtype_names(parts[0], CRITIC_FIELDS), actor_layout, PAD)
        a, b = slice_bounds(len(full), 2)[ps.dp_rank]
        want = full.select(slice(a, b))
        for f in CRITIC_FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert got.old_log_probs is None and got.routed_experts is None and got.returns is None
        if ps.is_dp_leader:
            send_values(bridge, _values(got), PARTS, actor_layout)
        returns, mask = recv_returns(
            bridge,
            PARTS,
            got.response_length,
            dtype_names(parts[0], ("returns", "response_mask")),
            actor_layout,
        )
        assert torch.equal(returns, want.returns) and torch.equal(mask, want.response_mask)
    bridge.wait_sends()
    with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
        f.write("ok")


def test_each_rank_receives_its_rows_and_fields_over_the_bridge_group(tmp_path):
    run_forked_ranks(_worker, tmp_path, nproc=5)
    assert all((tmp_path / f"ok{r}").exists() for r in range(5))
