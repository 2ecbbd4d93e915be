"""How a rank ends: never outliving its launcher, and stopping cleanly when asked to.

* :func:`die_with_parent` (called first thing in every rank): the kernel sends the rank SIGKILL when
  its parent (torchrun's agent) dies, so ``kill -9`` of torchrun leaves no rank behind holding GPU
  memory or the checkpoint directory's lock; what the rank forks dies with it. ``launch/torchrun.sh``
  ties torchrun to itself the same way, with SIGTERM: a launcher killed by SIGKILL stops the job as a
  forwarded SIGTERM would (the ranks save their step and exit).
* :class:`PreemptionWatch` (installed by ``Trainer.fit`` for the training loop): SIGTERM, SIGINT,
  SIGUSR2 and SIGUSR1 (re-placement: the same save, then the launcher restarts the job) only set a
  flag (a rank keeps the first stop it got; a re-placement yields to a later stop); after each step
  every rank asks :meth:`PreemptionWatch.requested`, which agrees over the world (an all-reduce of
  each rank's signal in the explicit order :data:`PRECEDENCE`, where any stop outranks a re-placement),
  so all ranks save the same step together and leave with
  :class:`Preempted` (exit status 128 + the signal number: 143 for SIGTERM, 140 for SIGUSR2, 130 for
  SIGINT). A second SIGINT more than :data:`SECOND_INT_AFTER_S` after the first interrupts at once
  (KeyboardInterrupt); one closer to the first is the same Ctrl-C seen twice (the terminal sends it
  to the whole process group, and torchrun forwards its copy too).

The signal flow of a launch is: Slurm or the user -> ``launch/torchrun.sh`` (forwards once) -> torchrun
(forwards to its ranks, waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, then SIGKILL) -> the ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal this process gets when its parent thread exits."""
REPLACE = signal.SIGUSR1
"""The re-placement request: save like a stop, then ``launch/torchrun.sh`` starts the job again, which
reads trainer.placement.file anew (docs/placement.md). A stop signal on any rank outranks it."""
PRECEDENCE = (signal.SIGUSR1, signal.SIGINT, signal.SIGUSR2, signal.SIGTERM)
"""The handled signals, weakest first: a re-placement yields to every stop; among the stops the
scheduler's SIGTERM (a hard kill follows it) outranks Slurm's early-warning SIGUSR2, which outranks a
Ctrl-C. One rank keeps the first stop it received (torchrun, shutting its workers down after it
forwarded a SIGUSR2, sends them a SIGTERM too: the job still stopped for the SIGUSR2), or a
re-placement until a stop comes; the ranks agree on the strongest of theirs."""
SIGNALS = tuple(reversed(PRECEDENCE))
SECOND_INT_AFTER_S = 2.0


def precedence(signum: int | None) -> int:
    """The value the ranks agree on by maximum: 0 for none, else 1 + the signal's place in
    :data:`PRECEDENCE` (an order, not the signal numbers: SIGINT is 2 and SIGUSR1 10, yet SIGINT on one
    rank and SIGUSR1 on another must stop the job, not restart it)."""
    if not signum:
        return 0
    if signum not in PRECEDENCE:
        raise ValueError(f"signal {signum} is not one the preemption watch handles ({SIGNALS})")
    return 1 + PRECEDENCE.index(signum)


def from_precedence(value: int) -> int | None:
    """Inverse of :func:`precedence`."""
    return int(PRECEDENCE[value - 1]) if value else None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Linux: ask the kernel to send ``sig`` to this process when its parent exits (whatever kills the
    parent, SIGKILL included). Returns False where that is unavailable (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect: nobody will signal us
        os.kill(os.getpid(), sig)
    global _children_die_with_us
    if not _children_die_with_us:
        # Processes this one forks (megatron-core's checkpoint writer forks one per file it writes)
        # die with it too: a kill -9 mid-save leaves no writer behind. Only forks of the main thread:
        # the kernel signals a child when the *thread* that forked it ends.
        os.register_at_fork(before=_note_forking_thread, after_in_child=lambda: _child_dies_with_parent(sig))
        _children_die_with_us = True
    return True


_children_die_with_us = False
_fork_from_main = False


def _note_forking_thread() -> None:
    global _fork_from_main
    import threading

    _fork_from_main = threading.current_thread() is threading.main_thread()


def _child_dies_with_parent(sig: int) -> None:
    if _fork_from_main:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _speaks() -> bool:
    """Rank 0 of the default process group (or a process without one) writes the notes."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class Preempted(SystemExit):
    """Raised on every rank after the checkpoint of a stop request is saved; the process exits with
    ``code`` (128 + the signal number) after the usual cleanup (``finally`` blocks run)."""


class PreemptionWatch:
    """Turns SIGTERM / SIGINT / SIGUSR2 into a flag that the training loop polls between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first stop signal received on this rank, else a re-placement (or, after
        :meth:`requested`, the strongest of the ranks' in :data:`PRECEDENCE`)."""
        self._first_int: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionWatch:
        """Handle the stop signals from now on (main thread only; Python's rule for signal handlers)."""
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionWatch:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if signum == signal.SIGINT:
            if self._first_int is not None and now - self._first_int > SECOND_INT_AFTER_S:
                raise KeyboardInterrupt
            if self._first_int is None:
                self._first_int = now
        if self.signum is not None and not (self.signum == REPLACE and signum != REPLACE):
            return  # a stop is kept (SIGUSR1 or torchrun's SIGTERM after it change nothing)
        first, self.signum = self.signum is None, signum
        if first and _speaks():
            # os.write, not print: a handler may run in the middle of another print (reentrant I/O).
            then = (
                "exiting for re-placement" if signum == REPLACE else "exiting (a second Ctrl-C stops at once)"
            )
            note = (
                f"megatron-rl: received {signal.Signals(signum).name}; finishing this step, then saving "
                f"a checkpoint and {then}\n"
            )
            try:
                os.write(sys.stderr.fileno(), note.encode())
            except (OSError, ValueError):
                pass

    def requested(self, group: Any = None, device: Any = None) -> bool:
        """Collective over ``group`` (default: the world): True on every rank if any rank received a
        stop signal. Without a process group, this rank's flag."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signum is not None
        t = torch.tensor([precedence(self.signum)], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        got = int(t.item())
        if got:
            # every rank leaves for the same signal: a stop anywhere outranks a re-placement
            self.signum = from_precedence(got)
        return got > 0

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    @property
    def exit_code(self) -> int:
        """128 + the signal number: what a shell reports for a process that the signal ended."""
        return 128 + (self.signum or signal.SIGTERM)
