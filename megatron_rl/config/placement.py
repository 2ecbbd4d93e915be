"""Which global ranks hold which role: ``trainer.placement.*`` resolved against the launch's world size.

    trainer.placement.{actor,critic,rollout}  (or the YAML file trainer.placement.file names)
        -> resolve_placement(cfg, world_size)  one line naming the key for a layout that cannot work
        -> Placement                           parallel.init_parallel builds this rank's world from it

Each role is either on the actor's ranks or on ranks of its own:

* colocated (the default): every role on every rank; the rollout engine lives in the training
  processes and takes the GPU only while it generates (the hybrid engine);
* separate rollout: the rollout ranks run only engines (``roles.remote_rollout``), the actor's ranks only
  train. Each side has its own torch.distributed world (megatron's groups span exactly the actor's
  ranks); the actor's weights and the generations cross over the job's shared store and a weights
  group (``roles.remote_rollout``), which lets generation of step k+1 overlap training on step k
  (``actor_rollout_ref.rollout.max_staleness``);
* separate critic: the critic ranks form a world of their own (megatron's TP x PP x DP over them) and
  compute values and the critic update while the actor computes log-probs and updates
  (``megatron_rl.roles.critic``).

This module imports nothing heavy: it runs before any process group starts (preflight).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import Config

ROLES = ("actor", "critic", "rollout")


@dataclass(frozen=True)
class Placement:
    world_size: int
    actor: tuple[int, ...]
    """Global ranks of the actor (reference and reward models too): megatron's TP x PP x DP over them."""
    critic: tuple[int, ...]
    """Global ranks of the critic: the actor's, or ranks of its own (its own TP x PP x DP)."""
    rollout: tuple[int, ...]
    """Global ranks hosting engines (rollout TP over consecutive ranks of this list)."""

    @property
    def separate_rollout(self) -> bool:
        """The engines run on ranks of their own (not inside the training processes)."""
        return not set(self.rollout) & set(self.actor)

    @property
    def separate_critic(self) -> bool:
        """The critic trains on ranks of its own (not on the actor's)."""
        return not set(self.critic) & set(self.actor)

    def role_of(self, rank: int) -> str:
        """The role global rank ``rank`` serves: "rollout" or "critic" (on ranks of their own: a server
        for the actor's ranks) or "actor" (trains; colocated roles included). The one routing decision:
        train.py starts the process by it, :meth:`world_of` groups ranks by it."""
        if self.separate_rollout and rank in self.rollout:
            return "rollout"
        if self.separate_critic and rank in self.critic:
            return "critic"
        return "actor"

    def world_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s torch.distributed world: the actor's, the critic's or the rollout's."""
        return {"actor": self.actor, "critic": self.critic, "rollout": self.rollout}[self.role_of(rank)]

    def rollout_engines(self, engine_ranks: int) -> int:
        """Engines of a separate rollout (one per ``engine_ranks`` of its ranks: rollout.engine_ranks):
        the count the training side slices requests by and the rollout world's data-parallel size."""
        if engine_ranks < 1 or len(self.rollout) % engine_ranks:
            raise ConfigError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size x data_parallel_size = {engine_ranks} "
                f"does not divide the {len(self.rollout)} rollout ranks of "
                f"trainer.placement.rollout={list(self.rollout)}."
            )
        return len(self.rollout) // engine_ranks

    def idle_colocated_engines(self, tp: int, pp: int, engine_ranks: int) -> list[int]:
        """Ranks of the first pipeline stage hosting a colocated SGLang engine that never gets a prompt.
        The actor's ranks are cut into engine groups of ``engine_ranks`` consecutive ranks, each engine
        on its group's first rank; prompts reach an engine only from the DP leaders in its group
        (tensor- and pipeline-rank 0 of each replica: in megatron's tp-cp-ep-dp-pp order, every
        ``tp``-th of the first world/pp ranks). A group without a leader idles. With PP > 1 the groups
        of the later stages idle whatever ``engine_ranks`` (short of one engine over stages): not
        counted."""
        stage = len(self.actor) // pp  # ranks of the first pipeline stage
        leaders = set(range(0, stage, tp))  # positions in the actor's ranks
        groups = range(0, stage, engine_ranks)
        return [self.actor[g] for g in groups if not leaders & set(range(g, g + engine_ranks))]

    def describe(self) -> str:
        return f"actor {list(self.actor)}, critic {list(self.critic)}, rollout {list(self.rollout)}"


def _read_file(path: str) -> dict[str, list[int]]:
    # mypy resolves "yaml" to the checkout's yaml/ folder of configs (a namespace package), not PyYAML
    from yaml import YAMLError, safe_load  # type: ignore[attr-defined]  # PyYAML ships no stubs

    key = "trainer.placement.file"
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path}: no such file; write one with actor/critic/rollout rank lists.")
    with open(path) as f:
        try:
            data = safe_load(f) or {}
        except YAMLError as e:
            raise ConfigError(f"{key}={path}: not valid YAML ({str(e).splitlines()[0]}).") from None
    unknown = sorted(set(data) - set(ROLES)) if isinstance(data, dict) else ["<not a mapping>"]
    if unknown:
        raise ConfigError(
            f"{key}={path}: unknown entries {unknown}; the file maps actor/critic/rollout to ranks."
        )
    return data


def _ranks(key: str, value, world_size: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value or not all(isinstance(r, int) for r in value):
        raise ConfigError(f"{key}={value!r} must be a non-empty list of global ranks, e.g. [0, 1].")
    bad = [r for r in value if not 0 <= r < world_size]
    if bad:
        raise ConfigError(
            f"{key}={list(value)}: rank {bad[0]} does not exist in this job of {world_size} processes "
            f"(ranks 0..{world_size - 1}); launch more processes or list existing ranks."
        )
    if len(set(value)) != len(value):
        raise ConfigError(f"{key}={list(value)} lists a rank twice.")
    return tuple(value)


def resolve_placement(cfg: Config, world_size: int) -> Placement:
    """The layout of this job (module docstring); raises ConfigError naming the key to change."""
    p = cfg.trainer.placement
    given = {"actor": p.actor, "critic": p.critic, "rollout": p.rollout}
    src = {r: f"trainer.placement.{r}" for r in ROLES}
    if p.file:
        given.update(_read_file(p.file))
        src = {r: f"trainer.placement.file={p.file} ({r})" for r in ROLES}
    ranks = {r: _ranks(src[r], given[r], world_size) for r in ROLES}
    everyone = tuple(range(world_size))
    taken = set(ranks["rollout"] or ()) | set(ranks["critic"] or ())
    actor = ranks["actor"] or tuple(r for r in everyone if r not in taken)
    if not actor:
        raise ConfigError(f"{src['rollout']} and {src['critic']} take every rank: leave ranks for the actor.")
    rollout, critic = ranks["rollout"] or actor, ranks["critic"] or actor
    for role, own in (("rollout", rollout), ("critic", critic)):
        if set(own) & set(actor) and set(own) != set(actor):
            raise ConfigError(
                f"{src[role]}={list(own)} shares some ranks with the actor's {list(actor)}: give the "
                f"{role} the actor's ranks (colocated, the default) or ranks of its own."
            )
    if set(critic) & set(rollout) and set(critic) != set(actor):
        raise ConfigError(
            f"{src['critic']}={list(critic)} shares ranks with {src['rollout']}={list(rollout)}: a critic on "
            "ranks of its own needs ranks no engine uses."
        )
    idle = [r for r in everyone if r not in actor and r not in rollout and r not in critic]
    if idle:
        raise ConfigError(
            f"rank {idle[0]} has no role (actor {list(actor)}, critic {list(critic)}, rollout "
            f"{list(rollout)}): add it to one of trainer.placement.actor/critic/rollout, or launch "
            f"{world_size - len(idle)} processes."
        )
    placement = Placement(world_size, actor, critic, rollout)
    _check_with_config(cfg, placement)
    return placement


def _check_with_config(cfg: Config, pl: Placement) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    if pl.separate_critic and not cfg.critic.enable:
        raise ConfigError(
            f"trainer.placement.critic={list(pl.critic)} gives ranks to a critic that does not train "
            f"(critic.enable=false with algorithm.adv_estimator={cfg.algorithm.adv_estimator}): leave "
            "trainer.placement.critic unset, or use a critic (algorithm.adv_estimator=gae)."
        )
    if rollout.max_staleness > 0 and not pl.separate_rollout and not rollout.partial_rollout:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_staleness={rollout.max_staleness} overlaps generation with "
            "training, which needs rollout ranks of their own: set trainer.placement.rollout to ranks "
            "outside the actor's (e.g. trainer.placement.rollout=[2] on 3 processes), carry multi-turn "
            "episodes across steps (actor_rollout_ref.rollout.partial_rollout=true), or max_staleness=0."
        )
    if not pl.separate_rollout:
        return
    pl.rollout_engines(rollout.engine_ranks)  # the engines divide the rollout ranks
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(
            "algorithm.filter_groups.enable=true regenerates prompts inside a step, which runs only with the "
            "rollout on the actor's ranks: leave trainer.placement.rollout unset, or turn the filter off."
        )
