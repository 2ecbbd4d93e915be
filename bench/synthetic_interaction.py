"""A simulated user for the multi-turn benchmark (bench/multi_turn.py).

    interaction:
      - name: synthetic
        class_name: bench.synthetic_interaction.SyntheticInteraction
        config: {reply: "t0 t1 t2 t3", replies: 2, delay_s: 0.0, turn_tokens: 64, timing_path: /x.jsonl}

It answers every assistant turn with the fixed ``reply`` (after sleeping ``delay_s``, standing for a
tool's latency) and ends the episode after ``replies`` answers; with
``multi_turn.max_assistant_turns = replies + 1`` every episode has that many model turns.

A random model never ends its turn (it practically never samples a stop token), and the agent loop has
no per-turn token cap: each turn may use the whole response budget left. With ``turn_tokens`` set,
the interaction caps every model turn of the agent loop at that many tokens, as if the model had
ended its turn there: the engine gets ``max_new_tokens = min(turn_tokens, budget left)`` and a turn cut
by that cap (not by the budget) counts as finished by a stop token. The same wrapper times the
engine's calls, so that ``timing_path`` (JSON lines, written on global rank 0) records per rollout
the agent loop's seconds, the engine's seconds (the rest is waiting on the user/tools and the loop's
own work) and the model tokens generated on all data-parallel ranks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from megatron_rl.rollout.tools import BaseInteraction


class TurnCappedEngine:
    """An engine whose every ``generate`` call samples at most ``turn_tokens`` tokens per response;
    it counts the seconds spent in the engine and the tokens it returned."""

    def __init__(self, engine: Any, turn_tokens: int | None) -> None:
        self.engine, self.turn_tokens = engine, turn_tokens
        self.engine_s, self.tokens, self.calls = 0.0, 0, 0

    def generate(self, prompts: list[list[int]], params: Any) -> list:
        cap = params.max_new_tokens
        if self.turn_tokens:
            cap = min(cap, self.turn_tokens)
        start = time.perf_counter()
        gens = self.engine.generate(prompts, replace(params, max_new_tokens=cap))
        self.engine_s += time.perf_counter() - start
        self.calls += 1
        out = []
        for per_prompt in gens:
            row = []
            for g in per_prompt:
                self.tokens += len(g.token_ids)
                if cap < params.max_new_tokens and g.finish_reason == "length":
                    g = replace(g, finish_reason="stop")  # the turn ended; the episode's budget did not
                row.append(g)
            out.append(row)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def install_turn_cap(turn_tokens: int | None, timing_path: str | None) -> None:
    """Wrap ``AgentLoop.run``'s engine in :class:`TurnCappedEngine` (once per process)."""
    from megatron_rl.rollout import agent_loop

    if getattr(agent_loop.AgentLoop.run, "turn_capped", False):
        return
    original = agent_loop.AgentLoop.run

    def run(self, engine, prompts, params, items=None):
        capped = TurnCappedEngine(engine, turn_tokens)
        start = time.perf_counter()
        out = original(self, capped, prompts, params, items)
        run_s = time.perf_counter() - start
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if timing_path and rank0 and not params.validate:
            # every DP rank holds batch / dp_size episodes and generates as many tokens
            record = {
                "run_s": run_s,
                "engine_s": capped.engine_s,
                "engine_calls": capped.calls,
                "model_tokens": capped.tokens * self.ps.dp_size,
                "episodes": sum(len(g) for g in out) * self.ps.dp_size,
            }
            with open(timing_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return out

    run.turn_capped = True  # type: ignore[attr-defined]
    agent_loop.AgentLoop.run = run


class SyntheticInteraction(BaseInteraction):
    """Config: ``reply`` (the user's text), ``replies`` (answers before the episode ends),
    ``delay_s`` (seconds slept before each answer), ``turn_tokens`` (cap per model turn; None = the
    budget left), ``timing_path`` (where rollout timings go; None = nowhere)."""

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.reply = str(self.config.get("reply", "t0 t1 t2 t3"))
        self.replies = int(self.config.get("replies", 2))
        self.delay_s = float(self.config.get("delay_s", 0.0))
        self._answered: dict[str, int] = {}
        install_turn_cap(self.config.get("turn_tokens"), self.config.get("timing_path"))

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        iid = await super().start_interaction(instance_id, **kwargs)
        self._answered[iid] = 0
        return iid

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        count = self._answered.get(instance_id, 0) + 1
        self._answered[instance_id] = count
        if count > self.replies:
            return True, "", 0.0, {}
        return False, self.reply, 0.0, {}

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        self._answered.pop(instance_id, None)
