"""The critic's ranks, when trainer.placement.critic gives it ranks of its own: a server that works
through the actor's requests (protocol in ``roles.critic``, messages signed with the job's secret:
``roles.transport``) until "stop". Any other failure (a message not signed with the job's secret, a
bug) is left in the store for the actor's ranks, which raise it instead of timing out.

A failed save or load is acknowledged, not raised, so the actor's ranks fail together: each critic
rank logs its traceback (with its rank), rank 0 puts the first failure under ``ack/<i>`` as a plain
dict (:func:`failure`: its type, message, rank, traceback and whether it is a checkpoint problem), and
:func:`raise_failure` raises it on the actor's ranks: a :class:`CheckpointError` (one line, no
traceback: disk, permissions, missing files) only for a checkpoint problem, chained from a
:class:`CriticServerError` that carries the critic rank's traceback; anything else (a bug) is the
:class:`CriticServerError` itself.
"""

from __future__ import annotations

import datetime
import logging
import time
import traceback
from typing import TYPE_CHECKING

import torch

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config, resolve
from megatron_rl.errors import CheckpointError
from megatron_rl.microbatches import ForwardPasses
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.bridge import Layout
from megatron_rl.roles.critic_data import MESSAGE_TYPES, Bridge, recv_returns, recv_slice, send_values
from megatron_rl.roles.transport import all_gather_objects, job_mailbox, job_store

if TYPE_CHECKING:
    from megatron_rl.optim import ModelOptimizer

log = logging.getLogger(__name__)


class CriticServerError(RuntimeError):
    """A request failed on a critic rank; the message ends with that rank's traceback."""

    def __init__(self, message: str, rank: int, remote_traceback: str) -> None:
        super().__init__(f"{message}\n--- traceback on critic rank {rank} ---\n{remote_traceback.rstrip()}")
        self.rank, self.remote_traceback = rank, remote_traceback


def is_checkpoint_failure(e: BaseException) -> bool:
    """A problem with the checkpoint's files (disk, permissions, missing or unreadable files), as
    opposed to a bug in the code that writes or reads them."""
    if isinstance(e, (OSError, CheckpointError)):
        return True
    try:
        from megatron.core.dist_checkpointing.core import CheckpointingException
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        return False
    return isinstance(e, CheckpointingException)


def failure(e: BaseException, rank: int) -> dict:
    """The wire form of a failed request (plain values only: the store's format takes no pickles)."""
    return {
        "type": type(e).__name__,
        "message": str(e),
        "rank": rank,
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        "checkpoint": is_checkpoint_failure(e),
    }


def raise_failure(what: str, f: dict | None) -> None:
    """On the actor's ranks: raise the critic's acknowledged failure ``f`` of request ``what`` (None: it
    succeeded). A checkpoint problem becomes a CheckpointError chained from the remote traceback."""
    if f is None:
        return
    line = f"the critic ranks' {what} failed on critic rank {f['rank']}: {f['type']}: {f['message']}"
    remote = CriticServerError(line, f["rank"], f["traceback"])
    if f["checkpoint"]:
        raise CheckpointError(line) from remote
    raise remote


class CriticServer:
    """The critic ranks' side: serve the actor's requests in order until "stop"."""

    def __init__(self, cfg: Config, ps: ParallelState, side_file_dirs: tuple[str, ...] = ()) -> None:
        self.cfg, self.ps, self.side_file_dirs = cfg, ps, side_file_dirs
        self.box = job_mailbox(ps, "critic/", MESSAGE_TYPES)
        self._built: tuple[torch.nn.Module, ModelOptimizer] | None = None  # by the "init" request
        self.pad_id = 0
        self.mine: RolloutBatch | None = None  # this rank's slice of the step's batch
        self.parts: list[list[int]] = []  # [rows, prompt width, response width] of each actor DP part
        self.bridge: Bridge | None = None  # the group of both roles' ranks (the "link" request)
        self.actor: Layout | None = None  # the actor's ranks: DP rank, DP leaders
        self.passes = ForwardPasses.from_config(cfg)
        self.spec = resolve(cfg, ps.device, ps.dp_size).critic  # the facts the critic reads (config.specs)
        self.values_seconds = 0.0  # of the step's values request (perf/critic_busy_s adds the update's)

    def serve(self) -> int:
        """Handle requests until "stop"; returns how many were served. A failure (a message not signed
        with the job's secret, a bug) is left in the store for the actor's ranks
        (``Mailbox.report_failure``) and raised."""
        with self.box.reporting_failure(self.ps.global_rank):
            return self._serve()

    def _serve(self) -> int:
        i = 0
        while True:
            msg = self.box.take(f"req/{i}", self.ps.world_size)
            if msg["kind"] == "stop":
                return i
            getattr(self, f"_{msg['kind']}")(i, msg)
            i += 1

    def _init(self, i: int, msg: dict) -> None:
        from megatron_rl.roles.models import build_critic

        self.pad_id = msg["pad_id"]
        self._built = build_critic(self.cfg, self.ps, msg["total_steps"])
        layout = Layout.gather(self.ps)  # which critic ranks train which rows: the actor's ranks read it
        if self.ps.rank == 0:
            self.box.put("layout", layout.as_message())

    def _link(self, i: int, msg: dict) -> None:
        store, ps = job_store(self.ps), self.ps
        self.actor = Layout.of_message(msg["actor"])
        timeout = datetime.timedelta(minutes=self.cfg.trainer.dist_timeout_minutes)
        self.bridge = Bridge(ps, store, len(self.actor.dp_of_rank), ps.world_size, False, timeout)

    @property
    def model(self) -> torch.nn.Module:
        if self._built is None:
            raise RuntimeError("the critic server got a request before its init request")
        return self._built[0]

    @property
    def optim(self) -> ModelOptimizer:
        if self._built is None:
            raise RuntimeError("the critic server got a request before its init request")
        return self._built[1]

    def _linked(self) -> tuple[Bridge, Layout]:
        if self.bridge is None or self.actor is None:
            raise RuntimeError("the critic server got a batch before its link request")
        return self.bridge, self.actor

    def _values(self, i: int, msg: dict) -> None:
        from megatron_rl import ppo

        ps, start, (bridge, actor) = self.ps, time.perf_counter(), self._linked()
        self.parts = msg["parts"]  # [rows, prompt width, response width] of each actor DP part
        self.mine = mine = recv_slice(bridge, self.parts, msg["dtypes"], actor, self.pad_id)
        mine.values = ppo.compute_values(self.model, ps, mine, self.passes.values)  # [b, R]
        if ps.is_dp_leader:  # TP/PP peers hold the same values
            send_values(bridge, mine.values, self.parts, actor)
        bridge.wait_sends()
        self.values_seconds = time.perf_counter() - start

    def _update(self, i: int, msg: dict) -> None:
        from megatron_rl import ppo

        ps, step, start, mine = self.ps, msg["step"], time.perf_counter(), self.mine
        if mine is None:
            raise RuntimeError(f"the critic server got the update of step {step} before its values request")
        bridge, actor = self._linked()
        returns, mask = recv_returns(bridge, self.parts, mine.response_length, msg["dtypes"], actor)
        mine.returns, mine.response_mask = returns, mask  # [b, R]
        n = self.spec.rollout_n
        metrics = ppo.update_critic(
            self.model, self.optim, ps, mine, self.cfg.critic, n, shuffle_seed=msg["seed"]
        )
        self.mine = None
        if ps.rank == 0:
            if ps.device.type == "cuda":
                torch.cuda.synchronize(ps.device)
            metrics["perf/critic_busy_s"] = self.values_seconds + time.perf_counter() - start
            self.box.put(f"metrics/{step}", (metrics, self.optim.counters()))

    def _acknowledge(self, i: int, work, what: str = "request") -> None:
        """Run ``work()`` on every critic rank; rank 0 acknowledges request ``i`` with the first failure
        (:func:`failure`), which the actor's ranks raise (:func:`raise_failure`)."""
        try:
            work()
            error = None
        except Exception as e:  # reported to the actor's ranks, which fail the save or load
            log.error("critic rank %d: %s (request %d) failed", self.ps.rank, what, i, exc_info=True)
            error = failure(e, self.ps.rank)
        errors = all_gather_objects(error, None, self.ps.device)
        if self.ps.rank == 0:
            self.box.put(f"ack/{i}", next((e for e in errors if e is not None), None))

    def _save(self, i: int, msg: dict) -> None:
        import os

        from megatron_rl.run.checkpoint import save_optimizer
        from megatron_rl.weights.ckpt_write import save_torch_dist
        from megatron_rl.weights.hf_io import copy_side_files

        def work() -> None:
            out = os.path.join(msg["dir"], "critic")
            save_torch_dist(self.model, self.ps, out)
            if self.ps.rank == 0:
                copy_side_files(list(self.side_file_dirs), out)
            save_optimizer(self.optim, self.ps, os.path.join(msg["dir"], "critic_optim"))

        self._acknowledge(i, work, "save")

    def _load(self, i: int, msg: dict) -> None:
        import os

        from megatron_rl.run.checkpoint import load_optimizer
        from megatron_rl.weights.torch_dist import load_torch_dist

        def work() -> None:
            path = msg["path"]
            if not os.path.isdir(os.path.join(path, "critic")):
                raise FileNotFoundError(
                    f"{path} has no critic/: resume with the same algorithm (critic.enable)."
                )
            load_torch_dist(self.model, self.ps, os.path.join(path, "critic"))
            load_optimizer(self.optim, os.path.join(path, "critic_optim"))
            self.optim.load_counters(msg["counters"])

        self._acknowledge(i, work, "load")
