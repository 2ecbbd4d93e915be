"""How the colocated rollout turns prompts into generations, chosen once per run (:func:`make_generator`):

    EngineGenerator     the engine alone: one ``engine.generate`` per batch (multi_turn.enable=false)
    EpisodeGenerator    multi-turn episodes (multi_turn.enable): the built-in agent loop
                        (rollout.agent.agent_loop.AgentLoop), or with multi_turn.agent_function.path the
                        user's harness against the OpenAI-compatible endpoint
                        (rollout.agent.agent_function.AgentFunctionLoop); both take AgentLoop.run's
                        arguments. The episodes of training rollouts add to multi_turn/* (EpisodeStats),
                        with what their runs cost the engine (busy share, prefix-cache hits).

Either raises rollout.base.EngineFailure when the engine dies (the supervisor restarts it in place,
roles.rollout.supervisor); anything else propagates.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron_rl.config import Config
from megatron_rl.parallel import ParallelState
from megatron_rl.roles.rollout.role import Request
from megatron_rl.rollout import Generation, SamplingParams


class Generator(Protocol):
    """What the colocated rollout asks of its generator."""

    def run(
        self, engine: Any, prompt_ids: list[list[int]], params: SamplingParams, items: list | None
    ) -> list[list[Generation]]: ...

    def record(self, request: Request, gens: list[list[Generation]]) -> None:
        """After a request's generations: keep what the step's metrics report."""

    def metrics(self, ps: ParallelState) -> dict[str, float]:
        """The step's metrics (collective over the DP ranks), reset for the next step."""

    def shutdown(self) -> None: ...


class EngineGenerator:
    """The engine alone."""

    def run(
        self, engine: Any, prompt_ids: list[list[int]], params: SamplingParams, items: list | None
    ) -> list[list[Generation]]:
        return engine.generate(prompt_ids, params)

    def record(self, request: Request, gens: list[list[Generation]]) -> None:
        pass

    def metrics(self, ps: ParallelState) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        pass


class EpisodeGenerator:
    """Multi-turn episodes run by ``runner`` (AgentLoop or AgentFunctionLoop), counted in ``stats``
    (rollout.agent.episode_stats.EpisodeStats) for training rollouts."""

    def __init__(self, runner: Any, stats: Any) -> None:
        self.runner, self.stats = runner, stats

    def run(
        self, engine: Any, prompt_ids: list[list[int]], params: SamplingParams, items: list | None
    ) -> list[list[Generation]]:
        return self.runner.run(engine, prompt_ids, params, items)

    def record(self, request: Request, gens: list[list[Generation]]) -> None:
        if request.trains:  # with what the run cost the engine, where it ran (AgentLoop.last_run)
            self.stats.add(gens, getattr(self.runner, "last_run", None))

    def metrics(self, ps: ParallelState) -> dict[str, float]:
        return self.stats.pop(ps)

    def shutdown(self) -> None:
        self.runner.shutdown()


def make_agent(cfg: Config, ps: ParallelState, tokenizer) -> tuple[Any, Any]:
    """The multi-turn episode runner and its step statistics, or (None, None) without multi_turn.enable:
    the built-in agent loop, or with multi_turn.agent_function.path the user's harness against the
    OpenAI-compatible endpoint (rollout/agent/openai_server.py); both take AgentLoop.run's arguments."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None, None
    from megatron_rl.rollout.agent.agent_loop import AgentLoop, EpisodeStats

    if tokenizer is None:
        raise ValueError("actor_rollout_ref.rollout.multi_turn.enable needs make_generator(tokenizer=...)")
    if mt.agent_function.path:
        from megatron_rl.rollout.agent.agent_function import AgentFunctionLoop

        return AgentFunctionLoop(mt, tokenizer, cfg.data.max_prompt_length, ps.dp_rank), EpisodeStats()
    return AgentLoop(mt, ps, tokenizer), EpisodeStats()


def make_generator(cfg: Config, ps: ParallelState, tokenizer) -> Generator:
    """The run's generator (the module docstring)."""
    runner, stats = make_agent(cfg, ps, tokenizer)
    return EngineGenerator() if runner is None else EpisodeGenerator(runner, stats)
