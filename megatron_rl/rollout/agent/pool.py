"""The groups of episodes the host of an engine keeps in flight across steps under partial rollouts
(rollout.agent.partial runs them), by (DP rank, slot):

    pool.add(dp, slot, prompt, item)            # a prompt of DP leader ``dp`` enters slot ``slot``
    pool.restart_stale(version, max_staleness)  # groups that would train too stale start again
    pool.unstarted() / pool.running()           # groups to start, episodes to run
    pool.enough(quotas)                         # every leader has its quota of ended groups
    pool.take(dp, quota)                        # the first ``quota`` ended groups of ``dp``, removed
    pool.clear(release)                         # at a checkpoint: progress dropped, tools released
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.rollout.agent.episode import Episode


@dataclass
class Group:
    """One prompt's episodes in one slot of a DP leader."""

    dp: int
    slot: int
    prompt: list[int]
    item: Any
    """The prompt's data row (data.PromptItem), returned with the generations."""
    episodes: list[Episode] = field(default_factory=list)
    """Empty until the group starts (at the first run after it entered, or after a restart)."""
    ended: tuple[int, int] | None = None
    """(step, tick) when its last episode ended."""

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among its model tokens (None: none sampled yet; tokens of a turn
        whose run failed get their version when the episode goes on)."""
        vs = [v for e in self.episodes for v, m in zip(e.versions, e.mask, strict=False) if m]
        return min(vs) if vs else None


class EpisodePool:
    """The groups in flight on this host, by (dp, slot) (the module docstring)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, int], Group] = {}

    def add(self, dp: int, slot: int, prompt: list[int], item: Any) -> None:
        """A prompt enters a free slot; the same prompt again (a retried run) is a no-op."""
        g = self.groups.get((dp, slot))
        if g is not None:
            if g.prompt != list(prompt):
                raise RuntimeError(f"partial rollouts: slot {slot} of data-parallel rank {dp} is taken")
            return
        self.groups[(dp, slot)] = Group(dp, slot, list(prompt), item)

    def restart_stale(self, version: int, max_staleness: int, release: Callable[[Episode], None]) -> int:
        """Groups whose oldest token would lag the actor (``version``) by more than ``max_staleness``
        start again from their prompt (their tool instances released); returns how many."""
        stale = [
            g
            for g in self.groups.values()
            if (v := g.oldest_version) is not None and version - v > max_staleness
        ]
        for g in stale:
            self._reset(g, release)
        return len(stale)

    def unstarted(self) -> list[Group]:
        return [g for _, g in sorted(self.groups.items()) if not g.episodes]

    def running(self) -> list[Episode]:
        """Every episode not ended, in (dp, slot, sample) order."""
        return [e for _, g in sorted(self.groups.items()) for e in g.episodes if e.finish is None]

    def ended_count(self, dp: int) -> int:
        return sum(1 for g in self.groups.values() if g.dp == dp and g.ended is not None)

    def enough(self, quotas: dict[int, int]) -> bool:
        return all(self.ended_count(dp) >= q for dp, q in quotas.items())

    def take(self, dp: int, quota: int) -> list[Group]:
        """The first ``quota`` ended groups of ``dp`` (by when they ended, then slot), removed."""
        done = sorted(
            (g for g in self.groups.values() if g.dp == dp and g.ended is not None),
            key=lambda g: (g.ended, g.slot),
        )
        if len(done) < quota:
            raise RuntimeError(f"partial rollouts: {len(done)} groups ended on rank {dp}, {quota} needed")
        for g in done[:quota]:
            del self.groups[(dp, g.slot)]
        return done[:quota]

    def clear(self, release: Callable[[Episode], None]) -> None:
        """Drop every group (the documented rule at a checkpoint: the leaders send their prompts again,
        which start from scratch)."""
        for g in self.groups.values():
            self._reset(g, release)
        self.groups.clear()

    @staticmethod
    def _reset(g: Group, release: Callable[[Episode], None]) -> None:
        for e in g.episodes:
            if e.finish is None:  # an ended episode's tools were released at its end
                release(e)
        g.episodes, g.ended = [], None
