"""Partial rollouts (actor_rollout_ref.rollout.partial_rollout): one step's run of the episodes the
host of an engine keeps in flight across steps (their pool: rollout.agent.pool), and which of them the
step trains on.

    taken = run_window(loop, engine, new, quota, params, version, max_staleness)   # collective
      on the host (run_partial): the DP leaders' new prompts into the pool -> groups that would train
      too stale start again -> every unended episode runs until each leader has ``quota`` ended
      groups (pending turns are then not sent: their episodes stop before them) -> each leader's
      first ``quota`` ended groups, removed from the pool, back to it and its TP/PP peers

A *group* is one prompt's rollout.n episodes; a DP leader owns ``partial_rollout_window x
train_batch_size / DP`` *slots* (the leader's rollout role keeps which prompt index sits in which:
roles.rollout.partial). Each episode's turns sample with the seeds of (the step its group started,
dp, slot x n + sample, turn) (rollout.base.sample_seed): unique while the slot holds the group, and
those of an ordinary step when a group starts and ends in one step.

Ended groups are taken in the order they ended: ``(step, tick)``, tick the engine's count of rounds
(transformers engine) or turns (SGLang) when the group's last episode ended, ties by slot. Under
multi_turn.schedule=lockstep the rounds, and so the order, do not depend on timing: the same inputs
give the same batches, which is what makes a resumed run equal an uninterrupted one on the CPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from megatron_rl.rollout.agent import tools as tl
from megatron_rl.rollout.agent.episode import Episode
from megatron_rl.rollout.agent.pool import EpisodePool
from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.rollout.episode_engine import hosted

if TYPE_CHECKING:
    from megatron_rl.rollout.agent.agent_loop import AgentLoop

logger = logging.getLogger(__name__)

NewPrompt = tuple[int, list[int], Any]
"""(slot, prompt token ids, data row) of a prompt a DP leader sends into its window."""
Ask = tuple[int, list[NewPrompt], int] | None
"""What a DP leader sends the host for one step: (dp_rank, its new prompts, its quota of groups); None
from the other ranks."""
Taken = list[tuple[int, Any, list[Generation]]]
"""What it gets back: (slot, data row, the group's rollout.n generations) per group, in the order taken."""


def release(loop: AgentLoop, e: Episode) -> None:
    """An unended episode's tool instances released and its interaction finalized, here and now (its
    group starts again); a failure is logged, not raised."""
    for name, iid in e.instances.items():
        try:
            tl.call(loop.tools[name].release, iid)
        except Exception as exc:
            logger.warning("multi-turn: releasing tool %r on %s failed: %s", name, e.where, exc)
    if e.interaction_id is not None and e.interaction is not None:
        try:
            tl.call(loop.interactions[e.interaction].finalize_interaction, e.interaction_id)
        except Exception as exc:
            logger.warning("multi-turn: finalizing %r on %s failed: %s", e.interaction, e.where, exc)
    e.instances, e.interaction_id = {}, None


def run_partial(
    loop: AgentLoop,
    pool: EpisodePool,
    engine: Any,
    asks: list[Ask],
    params: SamplingParams,
    version: int,
    max_staleness: int,
) -> list[Taken | None]:
    """On the host, one step of partial rollouts for the DP leaders of ``asks``: their new prompts join
    the pool, groups too stale start again, every unended episode runs until each leader has its quota
    of ended groups (then the others stop before their next turn), and each leader's quota is taken.
    Tokens sampled now are stamped ``version`` (the actor the engine holds)."""
    quotas: dict[int, int] = {}
    for a in asks:
        if a is not None:
            dp, new, quota = a
            quotas[dp] = quota
            for slot, prompt, item in new:
                pool.add(dp, slot, prompt, item)
    pool.restart_stale(version, max_staleness, lambda e: release(loop, e))
    for g in pool.unstarted():  # new, or started again
        g.episodes = loop.episodes_of(g.prompt, g.item, g.dp, g.slot, params.n, params.step)
    owner = {id(e): g for g in pool.groups.values() for e in g.episodes}
    stopping = pool.enough(quotas)

    def stop() -> bool:
        return stopping

    def ended(e: Episode, tick: int) -> None:
        nonlocal stopping
        g = owner[id(e)]
        if g.ended is None and all(x.finish is not None for x in g.episodes):
            g.ended = (params.step, tick)
            stopping = stopping or pool.enough(quotas)

    loop.serve(engine, [] if stopping else pool.running(), params, version, stop, ended)
    abandoned = loop.abandoned_tool_calls
    out: list[Taken | None] = []
    for a in asks:
        if a is None:
            out.append(None)
            continue
        taken = pool.take(a[0], a[2])
        out.append(
            [(g.slot, g.item, [loop.generation(e, params, abandoned) for e in g.episodes]) for g in taken]
        )
    return out


def run_window(
    loop: AgentLoop,
    engine: Any,
    new: list[NewPrompt],
    quota: int,
    params: SamplingParams,
    version: int,
    max_staleness: int,
) -> Taken:
    """Collective, on every rank of the run: this DP leader's new prompts into its window, its
    ``quota`` ended groups back (the same on its TP/PP peers). The host of each rollout group runs
    :func:`run_partial` on the pool of its AgentLoop."""
    params.check()
    ask: Ask = (loop.ps.dp_rank, list(new), quota) if loop.ps.is_dp_leader else None

    def run_for(asks: list[Ask]) -> list[Taken | None]:
        return run_partial(loop, loop.window, engine, asks, params, version, max_staleness)

    taken = hosted(loop.ps, ask, loop.rollout_group(engine), loop.mp, run_for)
    if taken is None or len(taken) != quota:
        raise RuntimeError(
            f"rank {loop.ps.rank} received {taken and len(taken)} groups for a quota of {quota}"
        )
    return taken
