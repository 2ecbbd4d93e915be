"""A simulated user for the multi-turn benchmark (bench/multi_turn.py).

    interaction:
      - name: synthetic
        class_name: bench.synthetic_interaction.SyntheticInteraction
        config: {reply: "t0 t1 t2 t3", replies: 2, latency_median_s: 0.1, latency_p99_s: 2.0, seed: 0}

It answers every assistant turn with the fixed ``reply`` and ends the episode after ``replies``
answers (a row's ``extra_info.interaction_kwargs.replies`` overrides it: the long-tail episodes); with
``multi_turn.max_assistant_turns`` at least replies + 1 every episode has replies + 1 model turns.
Each answer comes after a latency standing for a tool's: 0 without ``latency_median_s``, else drawn from
the log-normal distribution of that median and of 99th percentile ``latency_p99_s``, seeded by
(seed, the row's ``interaction_kwargs.row``, the answer's number), so a run draws the same latencies
whatever the schedule. A random model practically never ends its turn: the benchmark caps each model
turn with ``multi_turn.max_tokens_per_turn``.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from megatron_rl.rollout.tools import BaseInteraction

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def lognormal_latency(median_s: float, p99_s: float, seed: int, row: int, answer: int) -> float:
    """One draw of the latency distribution (seconds): log-normal with median ``median_s`` and 99th
    percentile ``p99_s``, from a stream of its own per (seed, row, answer)."""
    if median_s <= 0:
        return 0.0
    sigma = math.log(max(p99_s, median_s) / median_s) / Z99
    rng = random.Random(f"{seed}:{row}:{answer}")
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


class SyntheticInteraction(BaseInteraction):
    """Config: ``reply`` (the user's text), ``replies`` (answers before the episode ends),
    ``latency_median_s`` / ``latency_p99_s`` (each answer's wait; median 0: none), ``seed``."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.reply = str(self.config.get("reply", "t0 t1 t2 t3"))
        self.replies = int(self.config.get("replies", 2))
        self.median_s = float(self.config.get("latency_median_s", 0.0))
        self.p99_s = float(self.config.get("latency_p99_s", 0.0))
        self.seed = int(self.config.get("seed", 0))
        self._answered: dict[str, int] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        iid = await super().start_interaction(instance_id, **kwargs)
        self._answered[iid] = 0
        return iid

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        count = self._answered.get(instance_id, 0) + 1
        self._answered[instance_id] = count
        if count > int(kwargs.get("replies", self.replies)):
            return True, "", 0.0, {}  # the episode's last model turn had no call: no tool to wait for
        wait = lognormal_latency(self.median_s, self.p99_s, self.seed, int(kwargs.get("row", 0)), count)
        if wait > 0:
            await asyncio.sleep(wait)
        return False, self.reply, 0.0, {}

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        self._answered.pop(instance_id, None)
