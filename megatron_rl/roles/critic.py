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

import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.config import Config
from megatron_rl.errors import CheckpointError
from megatron_rl.microbatches import ForwardPasses, TokenStats
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.transport import Mailbox, broadcast_object

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
