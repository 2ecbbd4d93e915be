"""The critic role as the loop sees it, whether it trains on the actor's ranks or on ranks of its own
(trainer.placement.critic).

    critic.begin_values(step, batch)      nothing            | post the batch: the critic ranks start
    batch.values = critic.values(batch)   the forward pass   | wait for the critic ranks' values
    critic.begin_update(batch, seed)      the update         | post returns and mask: they update
    metrics = critic.update_metrics()     the update's       | wait for their metrics
    critic.counters() / save(dir) / load(path, counters)     the critic ranks write/read critic*/

The loop calls them in that order around the actor's work (old log-probs between the first two, the
actor update between the last two), so a critic on ranks of its own computes values while the actor
computes log-probs and updates while the actor updates.

On ranks of its own the critic is a server (``CriticServer``) working through requests the actor's
rank 0 posts in the job's store (``rollout.remote.Mailbox`` under "critic/"); batches, values and
returns travel the same way, CPU tensors in the store's wire format (``rollout.wire``, never pickle):

    ("init", total_steps, pad_id)   build the critic and its optimizer (LR schedule over the run)
    ("values", step, parts)         actor DP rank p put batch/<step>/<p>; the critic concatenates the
                                    parts in DP order, its DP rank j computes values of slice j, its
                                    rank 0 puts values/<step>/<p> (part p's rows and response width)
    ("update", step, seed)          actor DP rank p put returns and response mask (rejection sampling
                                    may have masked rows since); update_critic on each slice; rank 0
                                    puts metrics/<step> (with perf/critic_busy_s, its seconds of
                                    values and update) and the optimizer's counters
    ("save", dir) / ("load", path, counters)   critic/ and critic_optim/ in the checkpoint; ack/<i>
    ("stop",)

A checkpoint has the same files either way (the counters ride in the actor's shard files), so a run
resumes in either placement. The critic's RNG state is not saved: nothing in it draws random numbers
(no dropout; mini-batch shuffling is seeded by the step).
"""

from __future__ import annotations

import time

import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import Config
from megatron_rl.errors import CheckpointError
from megatron_rl.microbatches import ForwardPasses, TokenStats
from megatron_rl.parallel import ParallelState
from megatron_rl.rollout.remote import Mailbox, slice_bounds
from megatron_rl.rollout.wire import all_gather_objects, broadcast_object

MESSAGE_TYPES = (RolloutBatch, SeqMeta)
"""The dataclasses the critic's messages carry."""


class LocalCritic:
    """The critic on the actor's ranks: each call does its work there and then."""

    def __init__(self, cfg: Config, ps: ParallelState, model, optim, passes: ForwardPasses) -> None:
        self.cfg, self.ps, self.model, self.optim, self.passes = cfg, ps, model, optim, passes
        self._metrics: dict[str, float] = {}

    def begin_values(self, step: int, batch: RolloutBatch) -> None:
        pass

    def values(self, batch: RolloutBatch, stats: TokenStats | None = None) -> torch.Tensor:
        from megatron_rl import ppo

        return ppo.compute_values(self.model, self.ps, batch, self.passes.values, stats=stats)

    def begin_update(self, batch: RolloutBatch, seed: int, stats: TokenStats | None = None) -> None:
        from megatron_rl import ppo

        n = self.cfg.actor_rollout_ref.rollout.n
        self._metrics = ppo.update_critic(
            self.model, self.optim, self.ps, batch, self.cfg.critic, n, shuffle_seed=seed, stats=stats
        )

    def update_metrics(self) -> dict[str, float]:
        return self._metrics

    def shutdown(self) -> None:
        pass


class RemoteCritic:
    """The actor's side of a critic on ranks of its own (module docstring). Every call is collective
    over the actor's ranks; only rank 0 posts requests."""

    def __init__(self, ps: ParallelState, total_steps: int, pad_id: int) -> None:
        self.ps, self.box = ps, Mailbox(ps.job_store, "critic/", MESSAGE_TYPES)
        self.posted = 0
        self.step = 0
        self._counters: dict[str, int] = {"num_steps": 0, "skipped_steps": 0}
        self._post({"kind": "init", "total_steps": total_steps, "pad_id": pad_id})

    @property
    def _puts_rows(self) -> bool:
        """One rank per actor DP replica sends its rows (TP/PP peers hold the same)."""
        return self.ps.tp_rank == 0 and self.ps.pp_rank == 0

    def _post(self, msg: dict) -> int:
        i = self.posted
        if self.ps.rank == 0:
            self.box.put(f"req/{i}", msg)
        self.posted += 1
        return i

    def begin_values(self, step: int, batch: RolloutBatch) -> None:
        self.step = step
        if self._puts_rows:
            self.box.put(f"batch/{step}/{self.ps.dp_rank}", batch.to(torch.device("cpu")))
        self._post({"kind": "values", "step": step, "parts": self.ps.dp_size})

    def values(self, batch: RolloutBatch, stats: TokenStats | None = None) -> torch.Tensor:
        ps = self.ps
        values = self.box.take(f"values/{self.step}/{ps.dp_rank}", ps.tp_size * ps.pp_size)
        return values.to(ps.device)

    def begin_update(self, batch: RolloutBatch, seed: int, stats: TokenStats | None = None) -> None:
        if self._puts_rows:
            rows = (batch.returns.cpu(), batch.response_mask.cpu())
            self.box.put(f"returns/{self.step}/{self.ps.dp_rank}", rows)
        self._post({"kind": "update", "step": self.step, "seed": seed})

    def update_metrics(self) -> dict[str, float]:
        metrics, self._counters = self.box.take(f"metrics/{self.step}", self.ps.world_size)
        return metrics

    def counters(self) -> dict[str, int]:
        """The critic optimizer's counters as of its last update (saved in the actor's shard files)."""
        return dict(self._counters)

    def _ask(self, msg: dict) -> None:
        """Post ``msg``, wait for the critic ranks' acknowledgement; their error is raised on every rank."""
        i = self._post(msg)
        error = self.box.take(f"ack/{i}", 1) if self.ps.rank == 0 else None
        if self.ps.world_size > 1:
            error = broadcast_object(error, 0, None, self.ps.device)
        if error is not None:
            raise CheckpointError(f"the critic ranks: {error}")

    def save(self, directory: str) -> None:
        """The critic ranks write critic/ and critic_optim/ into ``directory`` (the partial checkpoint)."""
        self._ask({"kind": "save", "dir": directory})

    def load(self, path: str, counters: dict[str, int]) -> None:
        self._ask({"kind": "load", "path": path, "counters": counters})
        self._counters = dict(counters)

    def shutdown(self) -> None:
        self._post({"kind": "stop"})


class CriticServer:
    """The critic ranks' side: serve the actor's requests in order until "stop"."""

    def __init__(self, cfg: Config, ps: ParallelState, side_file_dirs: tuple[str, ...] = ()) -> None:
        self.cfg, self.ps, self.side_file_dirs = cfg, ps, side_file_dirs
        self.box = Mailbox(ps.job_store, "critic/", MESSAGE_TYPES)
        self.model = self.optim = None
        self.pad_id = 0
        self.mine: RolloutBatch | None = None  # this rank's slice of the step's batch
        self.part_rows: list[tuple[int, int]] = []  # (rows, response width) of each actor DP part
        self.passes = ForwardPasses.from_config(cfg)
        self.values_seconds = 0.0  # of the step's values request (perf/critic_busy_s adds the update's)

    def serve(self) -> int:
        """Handle requests until "stop"; returns how many were served."""
        i = 0
        while True:
            msg = self.box.take(f"req/{i}", self.ps.world_size)
            if msg["kind"] == "stop":
                return i
            getattr(self, f"_{msg['kind']}")(i, msg)
            i += 1

    def _init(self, i: int, msg: dict) -> None:
        from megatron_rl.roles import build_critic

        self.pad_id = msg["pad_id"]
        self.model, self.optim = build_critic(self.cfg, self.ps, msg["total_steps"])

    def _slice(self, rows: int) -> slice:
        a, b = slice_bounds(rows, self.ps.dp_size)[self.ps.dp_rank]
        return slice(a, b)

    def _values(self, i: int, msg: dict) -> None:
        from megatron_rl import ppo

        ps, step, start = self.ps, msg["step"], time.perf_counter()
        parts = [self.box.take(f"batch/{step}/{p}", ps.world_size) for p in range(msg["parts"])]
        self.part_rows = [(len(b), b.response_length) for b in parts]
        full = parts[0] if len(parts) == 1 else RolloutBatch.concat(parts, self.pad_id)
        self.mine = full.select(self._slice(len(full))).to(ps.device)
        self.mine.values = ppo.compute_values(self.model, ps, self.mine, self.passes.values)  # [b, R]
        # rank 0 collects every DP replica's slice and hands each actor DP rank its part
        slices: list = []
        if ps.tp_rank == 0 and ps.pp_rank == 0:  # no pickle: the store's wire format over the group
            slices = all_gather_objects(self.mine.values.cpu(), ps.dp_group, ps.device)
        if ps.rank == 0:
            values, first = torch.cat(slices), 0  # [B, R]
            for p, (rows, width) in enumerate(self.part_rows):
                self.box.put(f"values/{step}/{p}", values[first : first + rows, :width].clone())
                first += rows
        self.values_seconds = time.perf_counter() - start

    def _update(self, i: int, msg: dict) -> None:
        from megatron_rl import ppo

        ps, step, start = self.ps, msg["step"], time.perf_counter()
        width = self.mine.response_length
        parts = [self.box.take(f"returns/{step}/{p}", ps.world_size) for p in range(len(self.part_rows))]

        def full(k: int) -> torch.Tensor:  # [B, R]: the parts right-padded with zeros (off the mask)
            return torch.cat([torch.nn.functional.pad(t[k], (0, width - t[k].shape[1])) for t in parts])

        rows = self._slice(sum(n for n, _ in self.part_rows))
        self.mine.returns = full(0)[rows].to(ps.device)
        self.mine.response_mask = full(1)[rows].to(ps.device)
        n = self.cfg.actor_rollout_ref.rollout.n
        metrics = ppo.update_critic(
            self.model, self.optim, ps, self.mine, self.cfg.critic, n, shuffle_seed=msg["seed"]
        )
        self.mine = None
        if ps.rank == 0:
            if ps.device.type == "cuda":
                torch.cuda.synchronize(ps.device)
            metrics["perf/critic_busy_s"] = self.values_seconds + time.perf_counter() - start
            self.box.put(f"metrics/{step}", (metrics, self.optim.counters()))

    def _acknowledge(self, i: int, work) -> None:
        """Run ``work()`` on every critic rank; rank 0 acknowledges request ``i`` with the first error."""
        try:
            work()
            error = None
        except Exception as e:  # reported to the actor's ranks, which fail the save or load
            error = f"{type(e).__name__}: {e}"
        errors = all_gather_objects(error, None, self.ps.device)
        if self.ps.rank == 0:
            self.box.put(f"ack/{i}", next((e for e in errors if e is not None), None))

    def _save(self, i: int, msg: dict) -> None:
        import os

        from megatron_rl.checkpoint import save_optimizer
        from megatron_rl.weights.ckpt_write import save_torch_dist
        from megatron_rl.weights.hf_io import copy_side_files

        def work() -> None:
            out = os.path.join(msg["dir"], "critic")
            save_torch_dist(self.model, self.ps, out)
            if self.ps.rank == 0:
                copy_side_files(list(self.side_file_dirs), out)
            save_optimizer(self.optim, self.ps, os.path.join(msg["dir"], "critic_optim"))

        self._acknowledge(i, work)

    def _load(self, i: int, msg: dict) -> None:
        import os

        from megatron_rl.checkpoint import load_optimizer
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

        self._acknowledge(i, work)
