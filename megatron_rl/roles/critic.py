"""The critic role: one protocol whether it trains on the actor's ranks, on ranks of its own
(trainer.placement.critic), or not at all (GRPO and the other outcome estimators: ``NullCritic``).

    pending = critic.values_async(step, batch, stats)   at once            | post the batch: the critic
    ...                                                                     | ranks start computing
    batch.values = pending.result()                     the values [B, R]  | wait for their values
    pending = critic.update_async(step, batch, stats)   the update, at once | post returns and mask
    ...                                                                     | (they update meanwhile)
    metrics = pending.result()                          the update's        | wait for their metrics
    critic.register_state(registry)     critic/, critic_optim/ and the optimizer's counters in the
                                        checkpoint (remote: the counters ride in the actor's shard
                                        files, the critic ranks write their files before publishing)

NullCritic's handles hold None and {} (the values stay None; nothing updates). The loop calls these
around the actor's work (old log-probs between the first two, the actor update between the last two),
so a critic on ranks of its own computes values while the actor computes log-probs and updates while
the actor updates. Each call times itself under timing_s/values and timing_s/update_critic (remote:
the actor's wait for the critic ranks).

On ranks of its own the critic is a server (``roles.critic_server.CriticServer``) working through
requests the actor's rank 0 posts in the job's store (``roles.transport.Mailbox`` under "critic/");
the rows travel over a process group of both roles' ranks, each rank receiving only its own rows and
only the fields it reads (``roles.critic_data``):

    ("init", total_steps, pad_id)   build the critic and its optimizer (LR schedule over the run); its
                                    rank 0 puts its layout (DP rank of each critic rank)
    ("link", actor layout)          at the first batch: both roles build the bridge group
    ("values", step, parts, dtypes) each actor DP leader sends its part's rows to the critic ranks whose
                                    DP slice holds them; the critic's DP leaders send the values back
                                    to the actor ranks of each part
    ("update", step, seed, dtypes)  the actor DP leaders send returns and response mask the same way
                                    (rejection sampling may have masked rows since); update_critic on
                                    each slice; rank 0 puts metrics/<step> (with perf/critic_busy_s,
                                    its seconds of values and update) and the optimizer's counters
    ("save", dir) / ("load", path, counters)   critic/ and critic_optim/ in the checkpoint; ack/<i>
    ("stop",)

A checkpoint has the same files either way, so a run resumes in either placement. The critic's RNG
state is not saved: nothing in it draws random numbers (no dropout; mini-batch shuffling is seeded by
the step). A new kind of critic implements :class:`CriticRole`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import CriticConfig
from megatron_rl.config.specs import CriticSpec
from megatron_rl.microbatches import ForwardPasses, TokenStats
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.bridge import Layout, Route, row_routes
from megatron_rl.roles.critic_data import (
    CRITIC_FIELDS,
    MESSAGE_TYPES,
    RETURN_FIELDS,
    Bridge,
    dtype_names,
    recv_values,
    send_rows,
)
from megatron_rl.roles.transport import broadcast_object, job_mailbox, job_store
from megatron_rl.run.metrics import Timer
from megatron_rl.run.state import SHARD, StateRegistry

if TYPE_CHECKING:
    from megatron_rl.optim import ModelOptimizer


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Done(Generic[T]):
    """A handle whose work is done: ``result()`` returns it."""

    def __init__(self, value: T) -> None:
        self._value = value

    def result(self) -> T:
        return self._value


class Pending(Generic[T]):
    """A handle on posted work: ``result()`` waits for it (once; later calls return the same)."""

    def __init__(self, wait: Callable[[], T]) -> None:
        self._wait: Callable[[], T] | None = wait
        self._value: tuple[T, ...] = ()  # (the result,) once waited for

    def result(self) -> T:
        if self._wait is not None:
            self._value, self._wait = (self._wait(),), None
        return self._value[0]


@runtime_checkable
class Handle(Protocol[T_co]):
    def result(self) -> T_co: ...


@runtime_checkable
class CriticRole(Protocol):
    """What the loop asks of a critic (module docstring)."""

    @property
    def model(self) -> torch.nn.Module | None:
        """The critic's module on these ranks (None: on ranks of its own, or no critic)."""

    @property
    def optim(self) -> ModelOptimizer | None:
        """Its optimizer (roles.models.ModelOptimizer) on these ranks, or None."""

    def values_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Handle: ...

    def update_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Handle: ...

    def register_state(self, registry: StateRegistry) -> None: ...

    def shutdown(self) -> None: ...


class NullCritic:
    """No critic (critic.enable=false): no values, no update, nothing in the checkpoint."""

    model: torch.nn.Module | None = None
    optim: ModelOptimizer | None = None

    def values_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Done[None]:
        return Done(None)

    def update_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Done[dict[str, float]]:
        return Done({})

    def register_state(self, registry: StateRegistry) -> None:
        pass

    def shutdown(self) -> None:
        pass


class LocalCritic:
    """The critic on the actor's ranks: each call does its work there and then. The one home of the
    critic's module and optimizer on these ranks (parking, perf metrics and the checkpoint read them
    from here)."""

    def __init__(
        self,
        critic: CriticConfig,
        spec: CriticSpec,
        ps: ParallelState,
        model,
        optim,
        passes: ForwardPasses,
        timer: Timer,
    ) -> None:
        """``critic``: the critic section; ``spec``: config.specs.CriticSpec."""
        self.critic, self.spec, self.ps, self.model, self.optim = critic, spec, ps, model, optim
        self.passes, self.timer = passes, timer

    def values_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Done[torch.Tensor]:
        from megatron_rl import ppo

        with self.timer("values"):
            return Done(ppo.compute_values(self.model, self.ps, batch, self.passes.values, stats=stats))

    def update_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Done[dict[str, float]]:
        from megatron_rl import ppo

        n = self.spec.rollout_n
        with self.timer("update_critic"):  # seed: mini-batch shuffling, the step's
            metrics = ppo.update_critic(
                self.model, self.optim, self.ps, batch, self.critic, n, shuffle_seed=step, stats=stats
            )
        return Done(metrics)

    def register_state(self, registry: StateRegistry) -> None:
        registry.register_model("critic", self.model, self.optim)

    def shutdown(self) -> None:
        pass


class RemoteCritic:
    """The actor's side of a critic on ranks of its own (module docstring). Every call is collective
    over the actor's ranks; only rank 0 posts requests; the rows travel over the bridge group
    (``roles.critic_data``)."""

    model: torch.nn.Module | None = None
    optim: ModelOptimizer | None = None

    def __init__(
        self,
        ps: ParallelState,
        total_steps: int,
        pad_id: int,
        timer: Timer,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    ) -> None:
        self.ps, self.box, self.timer = ps, job_mailbox(ps, "critic/", MESSAGE_TYPES), timer
        self.timeout, self.posted = timeout, 0
        self._counters: dict[str, int] = {"num_steps": 0, "skipped_steps": 0}
        self._link: tuple[Bridge, Layout, Layout] | None = None  # at the first batch
        self._routes: dict[int, list[Route]] = {}  # step -> its routes, until its update
        self._post({"kind": "init", "total_steps": total_steps, "pad_id": pad_id})

    def _post(self, msg: dict) -> int:
        i = self.posted
        if self.ps.rank == 0:
            self.box.put(f"req/{i}", msg)
        self.posted += 1
        return i

    def _bridge(self) -> tuple[Bridge, Layout, Layout]:
        """The bridge group, the critic's layout (from the store, after its init) and the actor's."""
        if self._link is None:  # the critic ranks build the group as they read the "link" request
            actor = Layout.gather(self.ps)
            self._post({"kind": "link", "actor": actor.as_message()})
            critic = Layout.of_message(self.box.take("layout", self.ps.world_size))
            bridge = Bridge(
                self.ps, job_store(self.ps), self.ps.world_size, len(critic.dp_of_rank), True, self.timeout
            )
            self._link = bridge, critic, actor
        return self._link

    def _parts(self, batch: RolloutBatch) -> list[list[int]]:
        """[rows, prompt width, response width] of every actor DP part, in DP order (collective)."""
        ps = self.ps
        mine = torch.tensor([len(batch), batch.prompts.shape[1], batch.response_length], device=ps.device)
        every = [torch.zeros_like(mine) for _ in range(ps.dp_size)]
        dist.all_gather(every, mine, group=ps.dp_group)
        return [[int(x) for x in t] for t in every]

    def values_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Pending[torch.Tensor]:
        ps, parts = self.ps, self._parts(batch)
        bridge, critic, _ = self._bridge()
        msg = {"kind": "values", "step": step, "parts": parts, "dtypes": dtype_names(batch, CRITIC_FIELDS)}
        self._post(msg)
        routes = self._routes[step] = row_routes([p[0] for p in parts], max(critic.dp_of_rank) + 1)
        if ps.is_dp_leader:  # TP/PP peers hold the same rows
            send_rows(bridge, batch, ps.dp_rank, routes, critic, "batch")

        def wait() -> torch.Tensor:
            with self.timer("values"):
                with self.box.peer_cause():  # a critic rank that left: its own cause
                    values = recv_values(bridge, ps.dp_rank, parts[ps.dp_rank][2], routes, critic)
                    bridge.wait_sends()
                return values

        return Pending(wait)

    def update_async(self, step: int, batch: RolloutBatch, stats: TokenStats) -> Pending[dict[str, float]]:
        bridge, critic, _ = self._bridge()
        with self.timer("update_critic"):
            assert batch.returns is not None, "the advantage stage sets the returns"
            self._post(
                {"kind": "update", "step": step, "seed": step, "dtypes": dtype_names(batch, RETURN_FIELDS)}
            )
            routes = self._routes.pop(step)
            if self.ps.is_dp_leader:
                send_rows(bridge, batch, self.ps.dp_rank, routes, critic, "update")

        def wait() -> dict[str, float]:
            with self.timer("update_critic"):
                metrics, self._counters = self.box.take(f"metrics/{step}", self.ps.world_size)
                with self.box.peer_cause():
                    bridge.wait_sends()
            return metrics

        return Pending(wait)

    # checkpoint: the optimizer's counters in the actor's shard files, critic*/ written by the critic ranks
    def state_dict(self) -> dict[str, int]:
        """The critic optimizer's counters as of its last update."""
        return dict(self._counters)

    def load_state_dict(self, counters: dict[str, int]) -> None:
        self._counters = dict(counters)

    def save_files(self, partial_dir: str) -> None:
        """The critic ranks write critic/ and critic_optim/ into the partial checkpoint."""
        self._ask({"kind": "save", "dir": partial_dir})

    def load_files(self, path: str) -> None:
        self._ask({"kind": "load", "path": path, "counters": dict(self._counters)})

    def register_state(self, registry: StateRegistry) -> None:
        registry.register("critic_optim", self, SHARD)
        registry.register_files("critic", self)

    def _ask(self, msg: dict) -> None:
        """Post ``msg``, wait for the critic ranks' acknowledgement; their error is raised on every rank."""
        i = self._post(msg)
        error = self.box.take(f"ack/{i}", 1) if self.ps.rank == 0 else None
        if self.ps.world_size > 1:
            error = broadcast_object(error, 0, None, self.ps.device)
        from megatron_rl.roles.critic_server import raise_failure  # same layer; critic_server imports this

        raise_failure(msg["kind"], error)

    def shutdown(self) -> None:
        self._post({"kind": "stop"})


def make_critic(
    critic: CriticConfig,
    spec: CriticSpec,
    ps: ParallelState,
    built: tuple[torch.nn.Module, ModelOptimizer] | None,
    separate: bool,
    total_steps: int,
    pad_id: int,
    passes: ForwardPasses,
    timer: Timer,
) -> CriticRole:
    """The run's critic role: none (critic.enable=false), on ranks of its own (``separate``), or here
    with ``built`` (the module and optimizer roles.models.build_models made)."""
    if not spec.enabled:
        return NullCritic()
    if separate:
        timeout = datetime.timedelta(minutes=spec.dist_timeout_minutes)
        return RemoteCritic(ps, total_steps, pad_id, timer, timeout)
    if built is None:
        raise ValueError("critic.enable: build_models(with_critic=True) builds the critic for these ranks")
    return LocalCritic(critic, spec, ps, built[0], built[1], passes, timer)
