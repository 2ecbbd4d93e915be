"""The step's multi-turn metrics (multi_turn/*): episodes' turns and tool outcomes, and what their runs
cost the engine (busy share, prefix-cache hits, episode durations), reduced over the data-parallel group.

    stats = EpisodeStats(); stats.add(gens, run)    # run: AgentLoop.last_run on the rank that ran them
    metrics = stats.pop(ps)                          # collective over the DP ranks
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_rl.rollout.base import Generation

if TYPE_CHECKING:
    from megatron_rl.parallel import ParallelState

_SUMS = ("tool_calls", "tool_errors", "tool_timeouts", "dropped_calls")
_ENGINE = ("busy_s", "span_s", "prompt_tokens", "cached_tokens", "cache_reported", "model_tokens", "turns")


class EpisodeStats:
    """Accumulates episodes of a step; :meth:`pop` reduces them over the data-parallel group."""

    def __init__(self) -> None:
        self.turns: list[float] = []
        self.sums = dict.fromkeys(_SUMS, 0.0)
        self.length_ended = 0.0
        self.abandoned = 0.0  # timed-out tool calls still running on this rank (the latest run's)
        # the runs hosted on this rank: engine-busy and span seconds, context and cached tokens
        self.engine = dict.fromkeys(_ENGINE, 0.0)
        self.episode_s: list[float] = []

    def add(self, gens: list[list[Generation]], run: dict[str, Any] | None = None) -> None:
        """A rollout's episodes; ``run``: the host's AgentLoop.last_run (None elsewhere)."""
        if run is not None:
            for k in _ENGINE:
                self.engine[k] += float(run.get(k, 0.0))
            self.episode_s += list(run.get("episode_s", []))
        for per_prompt in gens:
            for g in per_prompt:
                info = g.info or {}
                self.turns.append(float(info.get("num_turns", 1)))
                for k in _SUMS:
                    self.sums[k] += float(info.get(k, 0))
                self.length_ended += float(g.finish_reason == "length")
                self.abandoned = float(info.get("abandoned_tool_calls", self.abandoned))

    def pop(self, ps: ParallelState) -> dict[str, float]:
        """multi_turn/num_turns/{mean,max,min}, multi_turn/<tool stat>_per_episode,
        multi_turn/length_ended_ratio, multi_turn/abandoned_tool_calls (the most timed-out calls still
        running on one rank), and from the hosts' runs multi_turn/engine_busy_ratio,
        multi_turn/episode_s/{median,max}, multi_turn/model_tokens, multi_turn/engine_turns and
        (SGLang) multi_turn/prefix_cache_hit_ratio; the same keys on every rank of the DP group."""
        n = float(len(self.turns))
        stats = torch.tensor(
            [n, sum(self.turns), self.length_ended, *(self.sums[k] for k in _SUMS)], dtype=torch.float64
        ).to(ps.device)
        hi = torch.tensor(
            [max(self.turns, default=-math.inf), -min(self.turns, default=math.inf), self.abandoned]
        ).to(ps.device)
        if ps.dp_size > 1:
            dist.all_reduce(stats, group=ps.dp_group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=ps.dp_group)
        eng = torch.tensor([self.engine[k] for k in _ENGINE], dtype=torch.float64).to(ps.device)
        med = statistics.median(self.episode_s) if self.episode_s else 0.0
        longest = torch.tensor([med, max(self.episode_s, default=0.0)], dtype=torch.float64).to(ps.device)
        if ps.dp_size > 1:
            dist.all_reduce(eng, group=ps.dp_group)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=ps.dp_group)
        EpisodeStats.__init__(self)  # the step's episodes are reduced: start the next step's
        total = max(stats[0].item(), 1.0)
        out = {
            "multi_turn/num_turns/mean": stats[1].item() / total,
            "multi_turn/num_turns/max": hi[0].item() if stats[0] > 0 else 0.0,
            "multi_turn/num_turns/min": -hi[1].item() if stats[0] > 0 else 0.0,
            "multi_turn/length_ended_ratio": stats[2].item() / total,
            "multi_turn/abandoned_tool_calls": hi[2].item(),
        }
        for j, k in enumerate(_SUMS):
            out[f"multi_turn/{k}_per_episode"] = stats[3 + j].item() / total
        busy, span, context, cached, reported, model_tokens, turns = eng.tolist()
        if span > 0:
            out["multi_turn/model_tokens"] = model_tokens  # the engine's tokens on every DP rank
            out["multi_turn/engine_turns"] = turns
            # the host ranks' seconds with a turn in the engine over their rollouts' seconds
            out["multi_turn/engine_busy_ratio"] = busy / span
            out["multi_turn/episode_s/median"] = longest[0].item()  # the largest rank median
            out["multi_turn/episode_s/max"] = longest[1].item()
        if reported and context > 0:  # SGLang's radix cache: context tokens it already held
            out["multi_turn/prefix_cache_hit_ratio"] = cached / context
        return out
