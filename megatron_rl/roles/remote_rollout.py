"""Rollout on ranks of its own (trainer.placement.rollout): engines that serve the training ranks.

    training ranks (RolloutClient)                          rollout ranks (RolloutServer.serve)
      leader posts req/<i> = ("weights", version)   ---->   every rollout rank takes req/<i> in order
      every actor rank runs the reshard stream;
      the leader broadcasts each bucket             ---->   rebuild the bucket, engine.update_weights
      leader posts req/<i> = ("generate", tag, ...) ---->   engine.generate on this engine's slice
      every rank takes res/<tag>/<slice>            <----   the slice's DP leader puts their lengths,
      and receives its rows' tensors                        finish reasons, infos, and sends each
                                                            training rank its rows (roles.rollout_data)
      leader posts req/<i> = ("stop",)              ---->   leave

Requests and the generations' small host-side parts travel through the job's key-value store
(torchrun's TCPStore; the generations' token ids, log-probs, masks and routed experts travel over the
*generations group*: ``roles.rollout_data``) in the store's wire format (``roles.transport``: signed
with the job's secret, a JSON header and raw tensor bytes, never pickle); a posted request does not
wait for the engines, so the trainer runs on while they generate. A message not signed with the job's
secret stops the rollout rank that reads it in one line naming its key; a rollout rank that fails
leaves its cause in the store, and the training ranks that wait for it (in the store or on the
generations group) raise that cause (``Mailbox.report_failure``) instead of timing out.

The server handles requests strictly in the order posted, so a generation request sees the weights of
every weights request posted before it: that order is the policy version of each sample, which the
training side records when it posts the request (roles.rollout); the generations carry no version of
their own.

Weights take the reshard stream unchanged (``reshard.iter_hf_buckets``: TP gather and PP broadcast
inside the actor's world); the actor's leader (training rank 0) holds every full bucket and
broadcasts its flat buffer over the *weights group* (the leader and the rollout ranks; NCCL on GPU,
gloo on CPU). The rollout ranks rebuild each bucket's views from the same plan
(``reshard.plan_buckets``, a pure function of the tables) and hand it to their engine. After the
stream the leader puts each streamed tensor's checksum (``rollout.checksums.tensor_checksum``) under
``sums/<i>``; every rollout rank whose engine holds weights compares its copy with them and stops on
the first tensor that differs (``reshard.WeightSyncError`` naming bucket, tensor and rank).

Prompts of one request are the training DP ranks' prompts concatenated in DP order; engine ``j`` of
``E`` (``Placement.rollout_engines``, the one count both sides use) generates the ``j``-th contiguous
slice, its rows seeded as data-parallel rank ``j``'s (rollout.base.sample_seed: with as many engines
as training DP ranks, slice j is DP rank j's prompts and its seeds are the colocated loop's).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.config.rollout_sections import AgentFunctionConfig, MultiTurnConfig, OpenAIServerConfig
from megatron_rl.model_args import DTYPES, ModelArgs
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.bridge import Bridge, Layout, row_routes
from megatron_rl.roles.rollout_data import GROUP, TAGS, header, receive_rows, send_generations
from megatron_rl.roles.transport import (
    all_gather_objects,
    broadcast_root,
    job_mailbox,
    job_store,
    pair_group,
    slice_bounds,
)
from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.rollout.bucket_plan import Bucket, make_bucket, plan_buckets
from megatron_rl.rollout.checksums import first_mismatch, tensor_checksum
from megatron_rl.rollout.reshard import WeightSyncError, iter_hf_buckets, unwrap


@dataclass(frozen=True)
class WeightsPlan:
    """What the rollout side needs to rebuild the buckets of the actor's reshard stream."""

    tp: int
    pp: int
    bucket_bytes: int
    dtype: str
    stage_layers: tuple[int, ...] = ()
    """The decoder layers of each pipeline stage of an uneven pipeline (empty: even)."""


MESSAGE_TYPES = (WeightsPlan, SamplingParams, MultiTurnConfig, AgentFunctionConfig, OpenAIServerConfig)
"""The dataclasses the rollout's requests carry."""


def episode_row(item) -> dict:
    """What a multi-turn episode reads of its prompt's data.PromptItem, as the store carries it."""
    return {
        "extra_info": dict(item.extra_info or {}),
        "messages": item.messages if isinstance(item.messages, list) else None,
        "index": int(item.index),
    }


class RolloutClient:
    """The training ranks' side: post weights and generation requests, take the generations."""

    def __init__(self, ps: ParallelState, placement, engine_ranks: int, timeout_minutes: float) -> None:
        """``placement``: the job's config.placement.Placement; ``engine_ranks``: the ranks one engine
        spans (rollout.engine_ranks)."""
        self.ps, self.box = ps, job_mailbox(ps, "rollout/", MESSAGE_TYPES)
        self.rollout_ranks, self.engines = len(placement.rollout), placement.rollout_engines(engine_ranks)
        self.timeout = datetime.timedelta(minutes=timeout_minutes)
        self.posted = 0  # requests posted (the leader's count: only it posts)
        self.engine_seconds: dict[str, float] = {}
        self._group = None
        self._layout: Layout | None = None  # the training ranks' DP ranks, at the first request
        self._bridge: Bridge | None = None  # the generations group, at the first generations
        self.pending: list[tuple[str, int]] = []  # (tag, prompts per DP rank) posted, not yet received
        self.got: dict[str, list[list[Generation]]] = {}  # received ahead of their tag's turn

    @property
    def leader(self) -> bool:
        return self.ps.rank == 0

    def _post(self, msg: dict) -> None:
        if self.leader:
            self.box.put(f"req/{self.posted}", msg)
            self.posted += 1

    def push_weights(self, actor: torch.nn.Module, bucket_megabytes: int, dtype: torch.dtype) -> None:
        """Collective over the training world: stream the actor to every engine. Waits until the engines
        have finished the requests posted before (they load weights between generations)."""
        ps = self.ps
        name = next(k for k, v in DTYPES.items() if v == dtype)
        split = tuple(getattr(unwrap(actor), "stage_layers", ()))
        plan = WeightsPlan(ps.tp_size, ps.pp_size, int(bucket_megabytes * 2**20), name, split)
        index = self.posted
        self._post({"kind": "weights", "plan": plan, "world": ps.world_size})
        if self._bridge is None:  # every rollout rank builds it as it reads its first weights request
            for r in range(self.rollout_ranks):  # (it says so first: PeerLeft if one left before)
                self.box.take(f"gens-link/{r}", ps.world_size)
            worlds = (ps.world_size, self.rollout_ranks)
            self._bridge = Bridge(ps, job_store(ps), GROUP, worlds, True, self.timeout, TAGS)
        if self.leader and self._group is None:
            self._group = pair_group(job_store(ps), 0, 1 + self.rollout_ranks, ps.backend, self.timeout)
        sums = []
        for bucket in iter_hf_buckets(actor, ps, plan.bucket_bytes, dtype):
            if self.leader:
                with self.box.peer_cause():  # a rollout rank that left says why in the store
                    broadcast_root(self._group, bucket.flat)
                sums += [tensor_checksum(t) for _, t in bucket]
        if self.leader:  # [tensors, 2] float64, in stream order: the engines check their copies
            self.box.put(f"sums/{index}", torch.stack(sums).cpu())

    def request(
        self,
        tag: str,
        prompts: list[list[int]],
        params: SamplingParams,
        rows: list[dict] | None = None,
        episodes: dict | None = None,
    ) -> None:
        """Collective over the training world: ask the engines for ``params.n`` responses to every DP
        rank's ``prompts`` (TP/PP peers pass the same); returns at once. Multi-turn: ``rows`` (one
        :func:`episode_row` per prompt) and ``episodes`` ({"multi_turn": its config, "tokenizer": path})."""
        ps = self.ps
        if self._layout is None:  # collective over the training world
            self._layout = Layout.gather(ps)
        self.pending.append((tag, len(prompts)))
        everyone: list = []
        if ps.is_dp_leader:  # every DP rank's prompts (and rows), in DP order (no pickle)
            everyone = all_gather_objects((prompts, rows), ps.dp_group, ps.device, MESSAGE_TYPES)
        if self.leader:
            flat = [p for part in everyone for p in part[0]]
            msg = {"kind": "generate", "tag": tag, "prompts": flat, "params": params}
            msg["parts"] = [len(part[0]) for part in everyone]  # prompts of each DP rank
            msg["layout"] = self._layout.as_message()  # who receives which rows
            if episodes is not None:
                msg["rows"] = [r for part in everyone for r in (part[1] or [])]
                msg["episodes"] = episodes
            self._post(msg)

    def receive(self, tag: str, per_rank: int) -> list[list[Generation]]:
        """This DP rank's generations of request ``tag`` (``per_rank`` prompts on every DP rank); waits
        for the engines, receiving the generations of the requests posted before it first (the order
        the engines send in). ``engine_seconds[tag]``: the longest time one of its engines spent."""
        if tag not in self.got and all(t != tag for t, _ in self.pending):
            raise RuntimeError(f"rollout request {tag} was never posted (RolloutClient.request posts it)")
        while tag not in self.got:
            first, n = self.pending.pop(0)
            self.got[first] = self._take(first, n)
        return self.got.pop(tag)

    def drain(self) -> None:
        """Receive every posted request's generations (the engines' sends complete before they stop)."""
        while self.pending:
            first, n = self.pending.pop(0)
            self._take(first, n)
            self.engine_seconds.pop(first, None)

    def _take(self, tag: str, per_rank: int) -> list[list[Generation]]:
        ps = self.ps
        if self._bridge is None:
            raise RuntimeError(f"rollout request {tag}: generations before the first weights push")
        out: list[list[Generation]] = []
        for route in row_routes([per_rank] * ps.dp_size, self.engines):
            if route.part != ps.dp_rank:
                continue
            a, b = slice_bounds(per_rank * ps.dp_size, self.engines)[route.dp]
            overlap = sum(1 for r in range(ps.dp_size) if a < (r + 1) * per_rank and b > r * per_rank)
            msg = self.box.take(f"res/{tag}/{route.dp}", ps.tp_size * ps.pp_size * overlap)
            out += receive_rows(self._bridge, self.box, msg, route)
            self.engine_seconds[tag] = max(self.engine_seconds.get(tag, 0.0), msg["seconds"])
        return out

    def stop(self) -> None:
        self._post({"kind": "stop"})


class RolloutServer:
    """The rollout ranks' side: one engine per group of rollout.engine_ranks ranks, serving requests
    until "stop"."""

    def __init__(
        self, engine, args: ModelArgs, ps: ParallelState, placement, engine_ranks: int, timeout_minutes: float
    ):
        """``ps``: the rollout ranks' world (engine_ranks x engines); ``placement``: the job's Placement."""
        self.engine, self.args, self.ps = engine, args, ps
        engines = placement.rollout_engines(engine_ranks)
        if ps.dp_size != engines:  # the training side slices every request into `engines` parts
            raise RuntimeError(
                f"the rollout world has {ps.dp_size} engines but the placement gives {engines} "
                f"(trainer.placement.rollout={list(placement.rollout)}, {engine_ranks} ranks an engine)"
            )
        self.box = job_mailbox(ps, "rollout/", MESSAGE_TYPES)
        rollout_ranks = list(placement.rollout)
        self.index = rollout_ranks.index(ps.global_rank)  # this rank's place in the weights group (minus 1)
        self.readers = len(rollout_ranks)
        self.timeout = datetime.timedelta(minutes=timeout_minutes)
        self._group = None
        self._bridge: Bridge | None = None  # the generations group, at the first generations
        self._loop: Any = None  # the multi-turn agent loop, built at the first episode request

    def serve(self) -> int:
        """Handle requests in order until "stop"; returns how many were served. A failure (a message
        not signed with the job's secret, an engine error) is left in the store for the training ranks
        (``Mailbox.report_failure``) and raised."""
        with self.box.reporting_failure(self.ps.global_rank):
            try:
                return self._serve()
            finally:
                self.close()

    def _serve(self) -> int:
        i = 0
        while True:
            msg = self.box.take(f"req/{i}", self.readers)
            i += 1
            if msg["kind"] == "stop":
                if self._bridge is not None:  # the training ranks received every request's rows
                    self._bridge.wait_sends()
                return i - 1
            if msg["kind"] == "weights":
                if self._bridge is None:  # both roles build it at the first weights request: all
                    self._link(msg["world"])  # their ranks are there (sends and receives are not)
                self.engine.update_weights(self._buckets(msg["plan"]))
                self._check(i - 1, msg["plan"])
            elif msg["kind"] == "generate":
                self._generate(msg)
            else:
                raise RuntimeError(f"unknown rollout request {msg['kind']!r}")

    def _link(self, training_world: int) -> None:
        """Join the generations group (``roles.rollout_data``) with the ``training_world`` training ranks,
        which wait for this rank's ``gens-link`` note first."""
        ps = self.ps
        self.box.put(f"gens-link/{ps.rank}", True)
        worlds = (training_world, self.readers)
        self._bridge = Bridge(ps, job_store(ps), GROUP, worlds, False, self.timeout, TAGS)

    def _check(self, index: int, plan: WeightsPlan) -> None:
        """Compare this engine's copy with the checksums the actor's leader sent after weights request
        ``index``; WeightSyncError (this rank) at the first tensor that differs."""
        sums = self.box.take(f"sums/{index}", self.readers)  # [tensors, CHECKSUM_SIZE]
        if not getattr(self.engine, "checks_weights", False):
            return
        itemsize = torch.empty((), dtype=DTYPES[plan.dtype]).element_size()
        buckets = plan_buckets(
            self.args, plan.tp, plan.pp, plan.bucket_bytes, itemsize, stage_layers=plan.stage_layers
        )
        names = [(k, t.name, t.numel) for k, b in enumerate(buckets) for s in b.params for t in s.tensors]
        got = self.engine.weight_checksums([n for _, n, _ in names])
        numel = torch.tensor([k for _, _, k in names])
        unread = getattr(self.engine, "unreadable", ())
        bad = first_mismatch([n for _, n, _ in names], sums, got, numel, unread)
        if bad is not None:
            k, name, _ = names[bad]
            raise WeightSyncError(
                f"weight sync check failed: the rollout engine on rank {self.ps.global_rank} does not hold "
                f"{name} (bucket {k + 1} of {len(buckets)}) as the actor streamed it, so it would generate "
                "from another policy; look for a weight-stream or engine-loading bug (docs/reliability.md, "
                "Sync integrity)."
            )

    def _buckets(self, plan: WeightsPlan) -> Iterator[Bucket]:
        ps = self.ps
        if self._group is None:
            self._group = pair_group(
                job_store(ps), 1 + self.index, 1 + self.readers, ps.backend, self.timeout
            )
        dtype = DTYPES[plan.dtype]  # the actor's side chose it (fp32 on CPU)
        itemsize = torch.empty((), dtype=dtype).element_size()
        buckets = plan_buckets(
            self.args, plan.tp, plan.pp, plan.bucket_bytes, itemsize, stage_layers=plan.stage_layers
        )
        flat = torch.empty(max(b.numel for b in buckets), dtype=dtype, device=ps.device)
        for b in buckets:
            broadcast_root(self._group, flat[: b.numel])
            yield make_bucket(b, flat)

    def _generate(self, msg: dict) -> None:
        ps = self.ps
        a, b = slice_bounds(len(msg["prompts"]), ps.dp_size)[ps.dp_rank]
        params: SamplingParams = msg["params"]
        start = time.perf_counter()
        if msg.get("episodes") is not None:  # multi-turn: the agent loop on this engine (collective)
            from types import SimpleNamespace

            items = [SimpleNamespace(**r) for r in msg["rows"][a:b]]
            gens = self._agent(msg["episodes"]).run(self.engine, msg["prompts"][a:b], params, items)
        else:
            gens = self.engine.generate(msg["prompts"][a:b], params) if b > a else []
        seconds = time.perf_counter() - start
        training = Layout.of_message(msg["layout"])
        assert self._bridge is not None  # built at the first weights request, which comes first
        if ps.is_dp_leader:  # the sends first (posted, not waited: the next request runs meanwhile)
            out = header(gens, seconds) | {"leader": ps.rank}
            self._bridge.forget_sent()
            routes = row_routes(msg["parts"], ps.dp_size)
            send_generations(self._bridge, gens, out, ps.dp_rank, routes, training)
            self.box.put(f"res/{msg['tag']}/{ps.dp_rank}", out)

    def _agent(self, episodes: dict):
        """The agent loop of the run's multi-turn config (built at its first request; collective)."""
        if self._loop is None:
            from transformers import AutoTokenizer

            from megatron_rl.rollout.agent.agent_loop import AgentLoop

            tokenizer = AutoTokenizer.from_pretrained(episodes["tokenizer"])
            self._loop = AgentLoop(episodes["multi_turn"], self.ps, tokenizer)
        return self._loop

    def close(self) -> None:
        """Stop the agent loop's tool threads (multi-turn)."""
        if self._loop is not None:
            self._loop.shutdown()
