"""The separate rollout's generations over the generations group (roles/rollout_data.py): over a real
gloo bridge group of seven processes (three training ranks: DP rank 0 with a TP peer, DP rank 1; four
rollout ranks: engine 0 with a TP peer, engines 1 and 2), each training rank receives exactly its DP
rank's generations (token ids, log-probs, masks, infos, routed experts) from exactly the engines whose
slices hold them, each engine's leader sends no row twice and none to a rank that does not read it (its
sends complete only if every one is received), and the store message of an engine holds no tensor and
nothing per token. A training rank waiting on the group for an engine that failed raises the engine
rank's own cause."""

from __future__ import annotations

import json
import os

from megatron_rl.roles.bridge import row_routes
from tests.conftest import run_forked_ranks

PER_RANK, N = 4, 2  # prompts per training DP rank, generations per prompt
ENGINES = 3  # slices of the 8 prompts: [0, 3), [3, 6), [6, 8): engine 1 holds rows of both DP ranks
TRAINING = ((0, 0, 1), (True, False, True))  # each training rank's DP rank, and DP leaders
ROLLOUT = ((0, 0, 1, 2), (True, False, True, True))


def _gens(prompt: int):
    """The oracle: prompt ``prompt``'s N generations (varying lengths, one empty response)."""
    import torch

    from megatron_rl.rollout.base import Generation

    out = []
    for k in range(N):
        g = torch.Generator().manual_seed(10 * prompt + k)
        n = 0 if (prompt, k) == (4, 1) else 3 + (prompt + k) % 4
        plen = 2 + prompt % 3
        out.append(
            Generation(
                torch.randint(1, 50_000, (n,), generator=g).tolist(),
                torch.randn(n, generator=g, dtype=torch.float64).tolist(),
                "stop" if k == 0 else "length",
                [int(x) for x in torch.randint(0, 2, (n,), generator=g)],
                {"num_turns": prompt + 1, "tool_calls": k},
                torch.randint(-1, 8, (plen + max(n, 1) - 1, 2, 2), generator=g, dtype=torch.int16),
            )
        )
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_rl.parallel import ParallelState
    from megatron_rl.roles.bridge import Bridge, Layout
    from megatron_rl.roles.rollout_data import GROUP, TAGS, header, recv_generations, send_generations
    from megatron_rl.roles.transport import MAGIC, decode, encode, slice_bounds

    training, rollout = Layout(*TRAINING), Layout(*ROLLOUT)
    is_training = rank < 3
    own = rank if is_training else rank - 3
    layout = training if is_training else rollout
    dp = layout.dp_of_rank[own]
    ps = ParallelState(
        rank=own, world_size=len(layout.dp_of_rank), local_rank=own, device=torch.device("cpu"),
        backend="gloo", tp_size=2 if own < 2 else 1, pp_size=1, dp_size=2 if is_training else ENGINES,
        tp_rank=1 if own == 1 else 0, pp_rank=0, dp_rank=dp,
        tp_group=None, pp_group=None, dp_group=None, mp_group=None, embedding_group=None,
    )  # fmt: skip
    store = dist.FileStore(init_file, 7)
    timeout = datetime.timedelta(seconds=50)
    bridge = Bridge(ps, store, GROUP, (3, 4), is_training, timeout, TAGS)
    routes = row_routes([PER_RANK, PER_RANK], ENGINES)
    got: dict = {}
    if not is_training:
        a, b = slice_bounds(2 * PER_RANK, ENGINES)[dp]
        gens = [_gens(p) for p in range(a, b)]
        msg = header(gens, 0.5) | {"leader": own}
        payload = encode(msg)  # what the store carries
        size = int.from_bytes(payload[len(MAGIC) : len(MAGIC) + 8], "little")
        assert json.loads(payload[len(MAGIC) + 8 : len(MAGIC) + 8 + size])["tensors"] == []
        per_gen = sum(len(p) for p in gens)
        for key, value in msg.items():  # nothing per token: at most one entry per generation
            assert not isinstance(value, list) or len(value) <= per_gen, key
        if ps.is_dp_leader:
            send_generations(bridge, gens, msg, dp, routes, training)
            path = os.path.join(out_dir, f"msg{dp}")
            with open(path + ".part", "wb") as f:  # whole or absent to the readers, which poll for it
                f.write(payload)
            os.replace(path + ".part", path)
        bridge.wait_sends()  # completes only once every send was received
    else:
        mine = []
        for route in routes:
            if route.part != dp:
                continue
            path = os.path.join(out_dir, f"msg{route.dp}")
            while not os.path.exists(path):
                import time

                time.sleep(0.01)
            with open(path, "rb") as f:
                msg = decode(f.read())
            leader = rollout.leader_of(route.dp)
            mine += recv_generations(bridge, msg, route, leader)
            got.setdefault("engines", []).append(route.dp)
        want = [_gens(p) for p in range(dp * PER_RANK, (dp + 1) * PER_RANK)]
        assert len(mine) == len(want)
        for per_got, per_want in zip(mine, want, strict=True):
            for g, w in zip(per_got, per_want, strict=True):
                assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
                assert g.finish_reason == w.finish_reason and g.response_mask == w.response_mask
                assert g.info == w.info and torch.equal(g.routed_experts, w.routed_experts)
    with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
        json.dump(got, f)


def test_each_training_rank_receives_its_rows_from_the_engines_that_hold_them(tmp_path):
    run_forked_ranks(_worker, tmp_path, nproc=7)
    took = [json.loads((tmp_path / f"ok{r}").read_text()) for r in range(7)]
    # DP rank 0 (ranks 0, 1: prompts 0-3) from engines 0 and 1; DP rank 1 (prompts 4-7) from 1 and 2
    assert [t.get("engines") for t in took[:3]] == [[0, 1], [0, 1], [1, 2]]
    assert took[3:] == [{}] * 4


def test_the_routes_split_an_engine_slice_across_two_dp_ranks():
    routes = row_routes([PER_RANK, PER_RANK], ENGINES)
    assert [(r.part, r.dp, r.part_rows, r.slice_rows) for r in routes] == [
        (0, 0, (0, 3), (0, 3)),
        (0, 1, (3, 4), (0, 1)),
        (1, 1, (0, 2), (1, 3)),
        (1, 2, (2, 4), (0, 2)),
    ]


def _dying_worker(rank: int, init_file: str, out_dir: str) -> None:
    """Rank 0: a training rank waiting for its rows on the group; rank 1: an engine's leader that fails
    (leaving its cause in the store, as RolloutServer.serve does) and leaves without sending."""
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_rl.job_secret import JobSecret
    from megatron_rl.parallel import ParallelState
    from megatron_rl.roles.bridge import Bridge
    from megatron_rl.roles.rollout_data import GROUP, TAGS, header, receive_rows
    from megatron_rl.roles.transport import Mailbox, PeerLeft

    ps = ParallelState(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", tp_size=1,
        pp_size=1, dp_size=1, tp_rank=0, pp_rank=0, dp_rank=0,
        tp_group=None, pp_group=None, dp_group=None, mp_group=None, embedding_group=None,
    )  # fmt: skip
    store = dist.FileStore(init_file, 2)
    box = Mailbox(store, JobSecret(b"k" * 32), "rollout/")
    bridge = Bridge(ps, store, GROUP, (1, 1), rank == 0, datetime.timedelta(seconds=50), TAGS)
    if rank == 1:
        box.report_failure(5, RuntimeError("CUDA out of memory in the engine"))
        os._exit(0)  # gone: its sends never come
    msg = header([_gens(0)], 0.5) | {"leader": 0}
    route = row_routes([1], 1)[0]
    try:
        receive_rows(bridge, box, msg, route)
    except PeerLeft as e:
        with open(os.path.join(out_dir, "cause"), "w") as f:
            f.write(str(e))


def test_a_training_rank_waiting_on_the_group_raises_the_engine_ranks_own_cause(tmp_path):
    run_forked_ranks(_dying_worker, tmp_path, nproc=2)
    cause = (tmp_path / "cause").read_text()
    assert cause.startswith("rollout rank 5 left: RuntimeError: CUDA out of memory in the engine"), cause
