"""The critic's ranks, when trainer.placement.critic gives it ranks of its own: a server that works
through the actor's requests (protocol in ``roles.critic``) until "stop".
"""

from __future__ import annotations

import time

import torch

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import Config
from megatron_rl.microbatches import ForwardPasses
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.critic import MESSAGE_TYPES
from megatron_rl.roles.transport import Mailbox, all_gather_objects, slice_bounds


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
        from megatron_rl.roles.models import build_critic

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

        from megatron_rl.run.checkpoint import save_optimizer
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

        self._acknowledge(i, work)
