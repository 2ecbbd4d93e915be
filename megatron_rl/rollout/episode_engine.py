"""Model turns one episode at a time on the in-process engines, and the routing that runs a rank's
episodes where its engine lives.

    server = turn_server(engine)                    # RoundServer (transformers, any engine) | SGLangTurns
    result = server.run(main())                     # main: every episode's coroutine, on the server's loop
    g = await server.turn(prefix, params, origin)   # one model turn of one episode (a Generation)
    server.stats                                    # turns, busy seconds, prompt / cached tokens

An episode submits its next turn as soon as its previous turn and its tool calls are done; no turn
waits for another episode's (``lockstep``: every turn waits for every live episode's, the
batch-synchronous schedule, kept for comparison).

* :class:`RoundServer` (the transformers engine on the CPU, or any engine with ``generate``): whatever
  turns are pending when the engine is free go into one batch (a *round*), run in a worker thread so
  that tools and the episodes' own work go on meanwhile. ``origin`` = (dp_rank, row) picks each
  turn's sampling seed (:func:`~megatron_rl.rollout.base.sample_seed`), so a turn's tokens do not
  depend on which other turns shared its round.
* :class:`SGLangTurns` (GPU): each turn is its own ``async_generate`` request on the engine's event
  loop; SGLang's scheduler batches the requests in flight continuously, and its radix cache reuses the
  episode's earlier context (``meta_info.cached_tokens``, counted in ``stats``).

:func:`run_hosted` is the collective around it: the DP leaders of a rollout group send their prompts
and data rows to the rank that hosts the group's engine (transformers: every DP leader hosts its own),
which runs all their episodes and sends each leader its generations; leaders broadcast them to their
TP/PP peers. One gather, one scatter and one broadcast per rollout, whatever the number of turns; a
failure on the host is raised on every rank it serves (rollout.agent.episode.raise_failure).
:func:`hosted` is that routing for any payload (partial rollouts send their window's new prompts and
get their step's groups back: rollout.agent.partial).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from megatron_rl.rollout.agent.episode import Failure, failure_of, raise_failure
from megatron_rl.rollout.base import (
    SGLANG_SEED_BITS,
    Generation,
    Origins,
    SamplingParams,
    on_host,
    sample_seed,
    split_back,
)

if TYPE_CHECKING:
    from megatron_rl.parallel import ParallelState

T = TypeVar("T")
TURN_ROW_STRIDE = 1 << 32
"""Turn t of response row r samples with the seed of row r + t * stride (rows stay below it): an
episode's turns, of the agent loop or of an endpoint session, each have their own seed."""
LocalGenerate = Callable[[list[list[int]], Origins, SamplingParams], list[list[Generation]]]


@dataclass
class TurnStats:
    """What one run's turns cost the engine (the host of the run's episodes)."""

    turns: int = 0
    rounds: int = 0
    """Engine calls: RoundServer's batches; SGLang: one per turn."""
    model_tokens: int = 0
    prompt_tokens: int = 0
    """Context tokens the turns sent (prompt + every earlier turn, for each turn)."""
    cached_tokens: int = 0
    """Of them, what the engine's prefix cache held (SGLang's meta_info.cached_tokens; 0 elsewhere)."""
    cache_reported: bool = False
    busy_s: float = 0.0
    """Seconds with at least one turn inside the engine."""
    span_s: float = 0.0
    """Seconds from the first turn's submission to the last episode's end."""


def cut_turn(g: Generation, max_new_tokens: int) -> Generation:
    """``g`` cut to ``max_new_tokens`` (a round samples the longest budget of its turns)."""
    if len(g.token_ids) <= max_new_tokens:
        return g
    lps = None if g.logprobs is None else g.logprobs[:max_new_tokens]
    return replace(g, token_ids=g.token_ids[:max_new_tokens], logprobs=lps, finish_reason="length")


class Suspended(Exception):
    """A turn the server did not run because the run is stopping (partial rollouts): the episode stops
    before it and goes on in a later run."""


class _Server:
    """Pending turns and the driver task that hands them to the engine (``_dispatch``)."""

    def __init__(self) -> None:
        self.stats = TurnStats()
        self.live: int | None = None
        """lockstep: episodes still running; a batch waits until each has a turn pending. None: async."""
        self._pending: list[tuple[list[int], SamplingParams, tuple[int, int], asyncio.Future]] = []
        self.stop: Callable[[], bool] | None = None
        """Partial rollouts: once it holds, pending turns are not sent to the engine; their episodes get
        :class:`Suspended` (under lockstep the decision falls between rounds, so it does not depend on
        timing)."""
        self._wake: asyncio.Event | None = None

    async def turn(self, prefix: list[int], params: SamplingParams, origin: tuple[int, int]) -> Generation:
        """One model turn of one episode: ``prefix`` (prompt + response so far) -> its Generation."""
        assert self._wake is not None  # inside run()
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending.append((list(prefix), params, origin, fut))
        self._wake.set()
        return await fut

    def leave(self) -> None:
        """An episode ended (lockstep: the batch no longer waits for it)."""
        if self.live is not None:
            self.live -= 1
            if self._wake is not None:
                self._wake.set()

    def _loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.new_event_loop()

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Run ``main`` (every episode) with the driver beside it, to the end."""
        loop = self._loop()
        try:
            return loop.run_until_complete(self._main(main))
        finally:
            if loop is not self._loop_kept():
                loop.run_until_complete(loop.shutdown_default_executor())
                loop.close()

    def _loop_kept(self) -> asyncio.AbstractEventLoop | None:
        return None

    async def _main(self, main: Coroutine[Any, Any, T]) -> T:
        self._wake = asyncio.Event()
        start = time.monotonic()
        driver = asyncio.ensure_future(self._drive())
        try:
            return await main
        finally:
            driver.cancel()
            with suppress(asyncio.CancelledError):
                await driver
            self.stats.span_s += time.monotonic() - start
            self._wake = None

    async def _drive(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending or (self.live is not None and len(self._pending) < self.live):
                continue
            await self._coalesce()
            batch, self._pending = self._pending, []
            if self.stop is not None and self.stop():  # partial rollouts: these turns wait for a later run
                for b in batch:
                    if not b[3].done():
                        b[3].set_exception(Suspended())
                continue
            self.stats.turns += len(batch)
            self.stats.prompt_tokens += sum(len(b[0]) for b in batch)
            await self._dispatch(batch)

    async def _coalesce(self) -> None:
        """Before a batch leaves: let turns arriving about now join it (RoundServer)."""

    async def _dispatch(self, batch: list) -> None:
        raise NotImplementedError


class RoundServer(_Server):
    """The pending turns as one batch of ``generate(prompts, origins, params)`` (module docstring)."""

    def __init__(self, generate: LocalGenerate) -> None:
        super().__init__()
        self._generate = generate
        self._last_round_s = 0.0

    async def _coalesce(self) -> None:
        # The engine is idle and a turn is pending. Turns whose tools return within a moment would
        # otherwise make a round of their own (one decode of a few rows costs about as much as one of
        # many): wait a tenth of the last round, at most 50 ms, so the engine loses at most that share.
        if self.live is None and self._last_round_s > 0:
            await asyncio.sleep(min(0.05, 0.1 * self._last_round_s))

    async def _dispatch(self, batch: list) -> None:
        start = time.monotonic()
        self.stats.rounds += 1
        try:  # a thread: the loop keeps running the episodes' tools and bookkeeping meanwhile
            out = await asyncio.to_thread(self._round, batch)
        except Exception as exc:
            for b in batch:
                if not b[3].done():
                    b[3].set_exception(exc)
            return
        finally:
            self._last_round_s = time.monotonic() - start
            self.stats.busy_s += self._last_round_s
        for b, gens in zip(batch, out, strict=True):
            g = cut_turn(gens[0], b[1].max_new_tokens)
            self.stats.model_tokens += len(g.token_ids)
            if not b[3].done():
                b[3].set_result(g)

    def _round(self, batch: list) -> list[list[Generation]]:
        """One engine call per seed step among the turns (one, unless partial rollouts carry episodes
        started in earlier steps: each turn samples with its episode's step), in batch order."""
        out: list[Any] = [None] * len(batch)
        for step in sorted({b[1].step for b in batch}):
            ks = [k for k, b in enumerate(batch) if b[1].step == step]
            params = replace(batch[ks[0]][1], n=1, max_new_tokens=max(batch[k][1].max_new_tokens for k in ks))
            got = self._generate([batch[k][0] for k in ks], [batch[k][2] for k in ks], params)
            for k, g in zip(ks, got, strict=True):
                out[k] = g
        return out


class SGLangTurns(_Server):
    """Each turn an ``async_generate`` request on the in-process SGLang engine (module docstring)."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.eng = engine  # rollout.sglang_engine.SGLangEngine, hosting its sglang.Engine
        self._inflight = 0
        self._busy_since = 0.0
        self._tasks: set[asyncio.Task] = set()

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self.eng.event_loop  # SGLang's tokenizer manager lives on the loop it was made on

    def _loop_kept(self) -> asyncio.AbstractEventLoop | None:
        return self.eng.event_loop

    async def _dispatch(self, batch: list) -> None:
        for b in batch:  # not awaited: the engine batches the requests in flight
            task = asyncio.ensure_future(self._one(*b))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, prefix: list[int], params: SamplingParams, origin: tuple[int, int], fut) -> None:
        if self._inflight == 0:
            self._busy_since = time.monotonic()
        self._inflight += 1
        self.stats.rounds += 1
        seed = None
        if params.seed is not None:
            dp, row = origin
            seed = sample_seed(params.seed, params.step, dp, row, params.validate, SGLANG_SEED_BITS)
        try:  # aborts, OOMs and a dead engine come back as the rollout's errors
            g, cached = await self.eng.generate_turn(prefix, params, seed)
        except Exception as exc:
            if not fut.done():
                fut.set_exception(exc)
            return
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self.stats.busy_s += time.monotonic() - self._busy_since
        if cached is not None:
            self.stats.cache_reported = True
            self.stats.cached_tokens += cached
        self.stats.model_tokens += len(g.token_ids)
        if not fut.done():
            fut.set_result(g)


def turn_server(engine: Any) -> _Server:
    """The per-episode server of ``engine`` on the rank that hosts it (module docstring): SGLang's async
    requests, the transformers engine's seeded rounds, or rounds of any other engine's ``generate``
    (a single-process engine: it is called on the host alone)."""
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    if isinstance(engine, SGLangEngine):
        engine.host_ready()
        return SGLangTurns(engine)
    if isinstance(engine, HFEngine):
        engine.host_ready()
        # the per-row seeded local generation: (dp_rank, row) of each turn picks its seed
        return RoundServer(engine.generate_local)
    return RoundServer(lambda prompts, origins, params: engine.generate(prompts, params))


# --------------------------------------------------------------------------------------------------
# Routing: the episodes of a rollout group run where its engine is
# --------------------------------------------------------------------------------------------------

Contribution = tuple[int, list[list[int]], list | None] | None
"""A DP leader's (dp_rank, prompts, data rows); None from the other ranks."""
RunLocal = Callable[[list[list[int]], list | None, Origins], list[list[Generation]]]


@dataclass
class _Failed:
    rank: int
    failure: Failure


def _run_for(contributions: list[Contribution], run: RunLocal) -> list:
    """On the host: ``run`` once on every contribution's prompts, cut back into one piece each."""
    flat = [p for c in contributions if c for p in c[1]]
    rows = [r for c in contributions if c for r in (c[2] if c[2] is not None else [None] * len(c[1]))]
    origins: Origins = [(c[0], i) for c in contributions if c for i in range(len(c[1]))]
    out = run(flat, rows if any(r is not None for r in rows) else None, origins) if flat else []
    if len(out) != len(flat):
        raise RuntimeError(f"the episodes returned {len(out)} results for {len(flat)} prompts")
    return split_back(contributions, out)


def hosted(
    ps: ParallelState,
    mine: Any,
    group: dist.ProcessGroup | None,
    mp_group: dist.ProcessGroup | None,
    run_for: Callable[[list[Any]], list[Any]],
) -> Any:
    """Collective: rollout.base.on_host with the host's failure raised on every rank it serves (past
    the collectives). ``mine``: this DP leader's contribution (None on the other ranks); ``group``: the
    rollout group (gloo) whose rank 0 hosts the engine, None when every DP leader hosts its own;
    ``mp_group``: a gloo twin of the model-parallel group, None without TP/PP peers."""
    ps.check_current()

    def guarded(contributions: list[Any]) -> list[Any]:
        try:
            return run_for(contributions)
        except Exception as exc:
            failed = _Failed(dist.get_rank() if dist.is_initialized() else 0, failure_of(exc))
            return [failed] * len(contributions)

    result = on_host(mine, group, mp_group, guarded)
    if isinstance(result, _Failed):
        raise_failure(result.failure, result.rank)
    return result


def run_hosted(
    ps: ParallelState,
    prompts: list[list[int]],
    items: list | None,
    params: SamplingParams,
    group: dist.ProcessGroup | None,
    mp_group: dist.ProcessGroup | None,
    run: RunLocal,
) -> list[list[Generation]]:
    """Collective: this rank's prompts -> their episodes' generations (module docstring; ``group``,
    ``mp_group``: :func:`hosted`)."""
    params.check()
    mine: Contribution = (
        (ps.dp_rank, list(prompts), list(items) if items else None) if ps.is_dp_leader else None
    )
    result = hosted(ps, mine, group, mp_group, lambda gathered: _run_for(gathered, run))
    if result is None or len(result) != len(prompts):
        raise RuntimeError(
            f"rank {ps.rank} passed {len(prompts)} prompts but received "
            f"{'no results' if result is None else len(result)} from its data-parallel leader: TP/PP "
            "peers of one data-parallel replica must pass identical prompts"
        )
    return result
