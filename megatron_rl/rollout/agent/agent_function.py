"""multi_turn.agent_function: the user's harness runs each episode through the OpenAI-compatible endpoint
(rollout/agent/openai_server.py) on the in-process engine.

    gens = run_agent_episodes(engine, tokenizer, items, agent_fn, params, cfg)   # gens[i]: params.n episodes

``agent_fn(item, base_url)`` runs in a thread per episode (at most endpoint.max_sessions at once) against
its own session; this thread runs the engine's turn server, on which each request is a turn of its
episode (as the built-in loop's turns, with their seeds: openai_server.py). Each episode comes
back as a Generation in AgentLoop.run's shape: its response is every token after the session's prompt
(model tokens mask 1, appended tool/user tokens mask 0), ``info["prompt_ids"]`` the session's prompt and
``info["agent_reward"]`` what the harness returned. An engine that fails mid-rollout fails the call
with its own exception, which roles/rollout.py handles as any failed generate (an EngineFailure: the
engine restarted in place and this call made again, every episode of the step from its start).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.config.rollout_sections import OpenAIServerConfig
from megatron_rl.errors import LaunchError
from megatron_rl.rollout.agent.openai_server import OpenAIServer, Session
from megatron_rl.rollout.agent.tool_pool import ToolPool
from megatron_rl.rollout.base import Generation, SamplingParams

if TYPE_CHECKING:
    from megatron_rl.config.rollout_sections import MultiTurnConfig


class AgentFunctionError(LaunchError):
    """The user's harness (multi_turn.agent_function) failed an episode: one line naming the prompt rows
    and what the harness raised. A LaunchError, so the failure explanation reports it as is (a harness's
    ``ConnectionResetError`` is not another rank dying)."""


AgentFn = Callable[[Any, str], "float | None"]
"""``agent_fn(item, base_url) -> reward or None``: the user's harness; ``item`` is the prompt's
data.PromptItem, ``base_url`` the session's OpenAI base URL."""


def load_agent_function(path: str, name: str) -> AgentFn:
    """Import function ``name`` from the Python file at ``path`` (multi_turn.agent_function.{path,name})."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"actor_rollout_ref.rollout.multi_turn.agent_function.path={path!r}: no such file"
        )
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]
    module_name = f"megatron_rl_agent_function_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(
            f"actor_rollout_ref.rollout.multi_turn.agent_function.path={path!r} cannot be imported as a "
            "Python module"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(
            f"actor_rollout_ref.rollout.multi_turn.agent_function.name={name!r}: no function of that name "
            f"in {path!r}"
        )
    return fn


class AgentFunctionLoop:
    """multi_turn.agent_function as the rollout's episode runner: :meth:`run` takes AgentLoop.run's
    arguments (roles/rollout.py calls either); each rank runs its own server on its own engine."""

    def __init__(
        self, cfg: MultiTurnConfig, tokenizer, max_prompt_tokens: int | None = None, dp_rank: int = 0
    ) -> None:
        path = cfg.agent_function.path
        if path is None:
            raise ValueError("actor_rollout_ref.rollout.multi_turn.agent_function.path is not set")
        self.fn = load_agent_function(path, cfg.agent_function.name)
        self.endpoint, self.tok, self.max_prompt_tokens = cfg.endpoint, tokenizer, max_prompt_tokens
        self.dp_rank = dp_rank  # its episodes' seeds: (dp_rank, row) as the agent loop's

    def run(
        self, engine, prompts: list[list[int]], params: SamplingParams, items: list | None = None
    ) -> list[list[Generation]]:
        """``items`` (data.PromptItem rows, one per prompt) go to the agent function; ``prompts`` are
        not used: each episode's prompt is its first request's messages, rendered."""
        if items is None or len(items) != len(prompts):
            raise ValueError("multi_turn.agent_function needs the prompts' data.PromptItem rows (items)")
        return run_agent_episodes(
            engine, self.tok, items, self.fn, params, self.endpoint, self.max_prompt_tokens, self.dp_rank
        )

    def shutdown(self) -> None:
        """Nothing to release: each run starts and stops its own server."""


def run_agent_episodes(
    engine,
    tokenizer,
    items: Sequence[Any],
    agent_fn: AgentFn,
    params: SamplingParams,
    cfg: OpenAIServerConfig | None = None,
    max_prompt_tokens: int | None = None,
    dp_rank: int = 0,
) -> list[list[Generation]]:
    """``params.n`` episodes per item, each ``agent_fn(item, base_url)`` against its own session, at most
    ``cfg.max_sessions`` at once; this thread drives the engine. Returns AgentLoop.run's shape: per item,
    n Generations (response = every token after the session's prompt, ``response_mask``, log-probs
    when ``params.return_logprobs``); ``info`` has agent_loop's keys plus ``prompt_ids`` (the session's
    prompt, which the batch must use) and ``agent_reward`` (what ``agent_fn`` returned).

    An exception in ``agent_fn``, an episode over ``episode_timeout_s`` or one that made no request
    fails the call with an :class:`AgentFunctionError` naming the prompt row. An engine that fails
    fails the call with what it raised, as a failed ``engine.generate`` of the agent loop does (its
    harnesses' requests get 503; the episodes done so far are dropped): the rollout role restarts an
    engine that raised rollout.base.EngineFailure and runs every episode of the step again.
    ``max_prompt_tokens``: as :class:`OpenAIServer`'s. Episode ``j`` of item ``i`` is seeded as row
    ``i * n + j`` of DP rank ``dp_rank`` (its turns as the built-in loop's)."""
    cfg = cfg or OpenAIServerConfig()
    n = params.n
    jobs = [(i, j) for i in range(len(items)) for j in range(n)]
    results: dict[tuple[int, int], Generation] = {}
    failures: list[str] = []
    pool = ToolPool(min(cfg.max_sessions, max(1, len(jobs))))
    server = OpenAIServer(engine, tokenizer, params, cfg, max_prompt_tokens).start()

    async def drive() -> None:  # on the engine's turn server: the sessions' requests are its turns
        running: dict[tuple[int, int], tuple[str, Any, float]] = {}  # job -> (session, future, start)
        waiting = list(jobs)
        while waiting or running:
            while waiting and len(running) < cfg.max_sessions:
                i, j = waiting.pop(0)
                eid = server.open_session(
                    f"{getattr(items[i], 'index', i)}-{j}-{uuid.uuid4().hex[:8]}", (dp_rank, i * n + j)
                )
                url = server.base_url(eid)
                running[(i, j)] = (
                    eid,
                    pool.submit(functools.partial(agent_fn, items[i], url)),
                    time.monotonic(),
                )
            await asyncio.sleep(0.01)
            if server.failure is not None:
                raise server.failure
            now = time.monotonic()
            for job, (eid, fut, start) in list(running.items()):
                if fut.done() or now - start > cfg.episode_timeout_s:
                    del running[job]
                    if not fut.done():
                        pool.abandon(fut)  # the stuck harness keeps its thread; the pool gets another
                    row = getattr(items[job[0]], "index", job[0])
                    got = _episode(server.close_session(eid), fut, params, cfg)
                    if isinstance(got, str):
                        failures.append(f"prompt row {row}: {got}")
                    else:
                        results[job] = got
            if failures:
                return

    try:
        server.serve(drive())
    finally:
        server.shutdown()
        pool.shutdown()
    if failures:
        raise AgentFunctionError(
            f"actor_rollout_ref.rollout.multi_turn.agent_function "
            f"({getattr(agent_fn, '__qualname__', agent_fn)}) failed: " + "; ".join(failures[:3])
        )
    return [[results[(i, j)] for j in range(n)] for i in range(len(items))]


def _episode(s: Session, fut: Any, params: SamplingParams, cfg: OpenAIServerConfig) -> Generation | str:
    """A closed session and its harness's future -> the episode, or why it failed."""
    if not fut.done():
        return f"agent_function ran past episode_timeout_s={cfg.episode_timeout_s:g}"
    exc = fut.exception()
    if exc is not None:
        return f"agent_function raised {type(exc).__name__}: {exc}"
    if s.prompt is None:
        return "agent_function made no chat request to its base_url"
    try:
        reward = agent_reward(fut.result())
    except ValueError as exc:
        return str(exc)
    g = s.generation(params.return_logprobs)
    assert g.info is not None  # Session.generation fills it
    g.info["agent_reward"] = reward
    return g


def agent_reward(value: Any) -> float | None:
    """What ``agent_fn`` returned as the episode's reward: None, or a finite float; anything else is a
    ValueError (a NaN reward would void the step's update)."""
    if value is None:
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        raise ValueError(
            f"agent_function returned {value!r}, not a finite number or None (its reward is trained on "
            "with actor_rollout_ref.rollout.multi_turn.tool_reward_weight)"
        )
    return reward
