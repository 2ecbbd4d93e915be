"""The thread pool that runs tool and interaction calls, each with a timeout (rollout/agent).

    pool = ToolPool(workers, max_abandoned)
    fut = pool.submit(job)                       # a ToolFuture: when it started, whether it was abandoned
    status, value = await wait_job(pool, fut, timeout_s)  # ok / error / timeout, and the value

A job that runs past its timeout is abandoned (its thread runs on, a fresh one takes its place), so a
hanging tool costs one thread, never the rollout; :func:`collect` is the blocking form for many jobs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

T = TypeVar("T")


class ToolRefused(RuntimeError):
    """A call the pool refused at once: too many timed-out calls are still running."""


class ToolFuture(Future[T]):
    """A pool job's Future: when it began running (time.monotonic), whether it returned or was abandoned."""

    started: float | None = None
    finished = False
    abandoned = False


class ToolPool:
    """``workers`` daemon threads running jobs, each returning a Future.

    A Python thread cannot be killed, so a job that runs past its timeout is *abandoned*
    (:meth:`abandon`): its thread stays inside the call and a fresh worker takes its place, up to
    ``workers + max_abandoned`` threads in all. The thread of an abandoned job exits when the job
    returns (the pool is back to ``workers``). With ``max_abandoned`` jobs abandoned and still running,
    :meth:`submit` refuses at once (a :class:`ToolRefused` future), and a queued job that no live
    worker is left to start can be cancelled (:meth:`refuse_queued`): the pool never holds more than
    ``workers + max_abandoned`` threads, however many calls hang.
    """

    def __init__(self, workers: int, max_abandoned: int | None = None) -> None:
        self._jobs: queue.SimpleQueue[tuple[ToolFuture[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.workers = workers
        self.max_abandoned = workers if max_abandoned is None else max_abandoned
        self._threads = 0  # alive: idle, busy or abandoned
        self._abandoned = 0  # of them, inside a job that was abandoned
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name="tool", daemon=True).start()

    @property
    def abandoned(self) -> int:
        """Abandoned jobs whose threads are still running."""
        with self._lock:
            return self._abandoned

    @property
    def threads(self) -> int:
        """Threads of the pool alive (idle, busy or abandoned)."""
        with self._lock:
            return self._threads

    @property
    def live(self) -> int:
        """Threads that take new jobs (not inside an abandoned one)."""
        with self._lock:
            return self._threads - self._abandoned

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                with self._lock:
                    self._threads -= 1
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            fut.started = time.monotonic()
            try:
                result, exc = fn(), None
            except BaseException as e:  # the caller reports it as the tool's error
                result, exc = None, e
            leave = False
            with self._lock:
                fut.finished = True
                if fut.abandoned:
                    # back from an abandoned job: its place went to a fresh worker, so this one goes,
                    # unless the cap left the pool short of workers
                    self._abandoned -= 1
                    leave = self._threads - self._abandoned > self.workers
                    if leave:
                        self._threads -= 1
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)
            if leave:
                return

    def submit(self, fn: Callable[[], T]) -> ToolFuture[T]:
        fut: ToolFuture[T] = ToolFuture()
        if self.abandoned >= self.max_abandoned:
            fut.set_exception(ToolRefused(self.refused()))
            return fut
        self._jobs.put((fut, fn))
        return fut

    def abandon(self, fut: ToolFuture[Any]) -> bool:
        """Stop waiting for ``fut``'s job: its thread runs on, another takes its place while the
        abandoned are fewer than ``max_abandoned``. False when the job has just finished (the caller
        reads its result instead)."""
        with self._lock:
            if fut.finished:
                return False
            if fut.abandoned:
                return True
            fut.abandoned = True
            self._abandoned += 1
            if self._threads < self.workers + self.max_abandoned:
                self._spawn()
            return True

    def refused(self) -> str:
        """The message of a refused call (names the cap's key)."""
        with self._lock:
            stuck = self._abandoned
        return (
            f"refused: {stuck} earlier tool calls timed out and still run "
            f"(multi_turn.max_abandoned_tool_calls={self.max_abandoned})"
        )

    def refuse_queued(self, fut: ToolFuture[Any]) -> bool:
        """Cancel ``fut`` if it has not started and every thread is inside an abandoned job (none is
        left to start it until a hung call returns); True when cancelled."""
        return self.live == 0 and fut.cancel()

    def shutdown(self) -> None:
        """Idle workers exit; an abandoned one exits when its job returns, or with the process."""
        for _ in range(self.threads):
            self._jobs.put(None)


def _outcome(f: ToolFuture[Any]) -> tuple[str, Any]:
    """A finished job's (status, value)."""
    exc = f.exception()
    if exc is None:
        return "ok", f.result()
    if isinstance(exc, ToolRefused):
        return "error", str(exc)
    return "error", f"{type(exc).__name__}: {exc}"


def _wakeup(fut: ToolFuture[Any], loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An asyncio event set (on ``loop``) when ``fut`` completes; safe after the loop has closed (an
    abandoned job may return long after its rollout)."""
    done = asyncio.Event()

    def ping(_f: Future) -> None:
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    fut.add_done_callback(ping)
    return done


async def wait_job(pool: ToolPool, fut: ToolFuture[Any], limit: float) -> tuple[str, Any]:
    """Wait for one job without blocking the event loop, up to ``limit`` seconds from when it started
    running: ("ok", result), ("error", message) for an exception or a refusal (:class:`ToolPool`'s cap),
    or ("timeout", None) after abandoning it to the pool."""
    done = _wakeup(fut, asyncio.get_running_loop())
    while True:
        if fut.done() and not fut.cancelled():
            return _outcome(fut)
        now = time.monotonic()
        if fut.started is not None and now - fut.started > limit:
            if pool.abandon(fut):  # else it has just finished: read it on the next pass
                return "timeout", None
            continue
        if fut.started is None and pool.refuse_queued(fut):
            return "error", pool.refused()
        # the nearest deadline: this job's timeout, or a queued job's next look at the pool
        left = limit if fut.started is None else fut.started + limit - now
        if pool.live == 0 or fut.started is None:
            left = min(left, 0.05)
        try:
            await asyncio.wait_for(done.wait(), timeout=max(0.001, left))
        except TimeoutError:
            pass


def collect(pool: ToolPool, items: list[ToolFuture[Any]], limit: float) -> list[tuple[str, Any]]:
    """Blocking: wait for the futures, each up to ``limit`` seconds from when it started running (as
    :func:`wait_job`), in the order given."""
    out: dict[int, tuple[str, Any]] = {}
    pending = set(range(len(items)))
    while pending:
        now = time.monotonic()
        for i in list(pending):
            f = items[i]
            if f.done() and not f.cancelled():
                out[i] = _outcome(f)
                pending.discard(i)
            elif f.started is not None and now - f.started > limit:
                if pool.abandon(f):  # else it has just finished: read on the next pass
                    out[i] = ("timeout", None)
                    pending.discard(i)
            elif f.started is None and pool.refuse_queued(f):
                out[i] = ("error", pool.refused())
                pending.discard(i)
        if pending:
            starts = [items[i].started for i in pending]
            nearest = min((s + limit - now for s in starts if s is not None), default=limit)
            if pool.live == 0:  # queued jobs wait for no one: look again soon
                nearest = min(nearest, 0.05)
            wait([items[i] for i in pending], timeout=max(0.001, nearest), return_when=FIRST_COMPLETED)
    return [out[i] for i in range(len(items))]
