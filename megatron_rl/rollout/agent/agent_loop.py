"""The multi-turn agent loop: every episode on its own against the in-process engine, tools and a
simulated user between the model's turns, token in and token out.

    loop = AgentLoop(multi_turn_cfg, ps, tokenizer)              # collective (a gloo twin of the mp group)
    gens = loop.run(engine, prompt_ids, params, items)           # collective; gens[i]: params.n episodes

Each episode is a coroutine on the host of its engine (rollout.episode_engine.run_hosted):

    prefix = prompt + response so far (token ids)  -> server.turn (n=1, the budget left): the engine's
                                                      next turn of this episode, whatever the others do
    model tokens appended, response_mask 1         -> parse the turn's text for tool calls (hermes)
    tool calls: jobs of the thread pool (multi_turn.tool_workers), each with its timeout; the episode
      awaits them while the engine decodes the other episodes' turns (a timeout, an exception or a
      malformed call becomes the tool message "Error: ...", never a crash)
    or else the interaction (a simulated user) answers the turn
    the new messages as token ids (the chat template's rendering of them after an assistant turn),
    appended with response_mask 0                  -> its next turn, submitted at once
    at its end: calc_reward and release of its tool instances, finalize of its interaction

An episode ends when a turn has no tool call and no interaction answers it, at
``max_assistant_turns`` / ``max_user_turns``, when an interaction says so, or when its response
(model + tool tokens) reaches ``params.max_new_tokens`` (= data.max_response_length): finish "length".
multi_turn.schedule=lockstep makes every turn wait for every live episode's instead (the
batch-synchronous schedule).

The training sequence is exactly prompt + the concatenation of what the engine produced and what was
appended: nothing is decoded and re-encoded as a whole. Turn t of response row r (prompt i, sample j:
r = i*n + j) of DP rank d samples with the seed of (d, r + t * 2**32) (rollout.base.sample_seed), so its
tokens do not depend on which turns of other episodes the engine batched with it. Episodes, tools
and interactions run only where the engine is hosted; the TP/PP peers get the finished episodes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_rl.rollout.agent import tools as tl
from megatron_rl.rollout.agent.episode import (
    Episode,
    TurnEncoder,
    clean_row,
    clean_text,
    finite_reward,
    truncate_text,
)
from megatron_rl.rollout.agent.episode_stats import EpisodeStats
from megatron_rl.rollout.agent.pool import EpisodePool
from megatron_rl.rollout.agent.tool_formats import ToolCall, looks_like_a_call, parse_tool_calls
from megatron_rl.rollout.agent.tool_pool import ToolFuture, ToolPool, ToolRefused, wait_job
from megatron_rl.rollout.base import Generation, Origins, SamplingParams, gloo_twin, object_group
from megatron_rl.rollout.episode_engine import TURN_ROW_STRIDE, Suspended, run_hosted, turn_server

if TYPE_CHECKING:
    from megatron_rl.config.rollout_sections import MultiTurnConfig
    from megatron_rl.parallel import ParallelState

# the names tests and harnesses import from here
__all__ = [
    "AgentLoop",
    "EpisodeStats",
    "ToolPool",
    "ToolRefused",
    "TurnEncoder",
    "clean_text",
    "truncate_text",
]

logger = logging.getLogger(__name__)


class AgentLoop:
    """See the module docstring; ``cfg`` is actor_rollout_ref.rollout.multi_turn."""

    def __init__(self, cfg: MultiTurnConfig, ps: ParallelState, tokenizer, tools: dict | None = None) -> None:
        self.cfg, self.ps, self.tok = cfg, ps, tokenizer
        if tools is None:
            tools = tl.load_tools(cfg.tool_config_path) if cfg.tool_config_path else {}
        self.tools = tools
        self.interactions = (
            tl.load_interactions(cfg.interaction_config_path) if cfg.interaction_config_path else {}
        )
        schemas = [tl.schema_dict(t.tool_schema) for t in self.tools.values()]
        self.encoder = TurnEncoder(tokenizer, schemas)
        self.mp = gloo_twin(ps, ps.mp_group) if ps.tp_size * ps.pp_size > 1 else None
        self._pool = ToolPool(cfg.tool_workers, cfg.max_abandoned_tool_calls) if ps.is_dp_leader else None
        self._groups: dict[int, dist.ProcessGroup] = {}
        self.window = EpisodePool()
        """Partial rollouts: the groups in flight on this host across steps (rollout.agent.partial)."""
        self.last_run: dict[str, Any] | None = None
        """The latest run's engine figures on the rank that hosted its episodes (None elsewhere):
        rollout.episode_engine.TurnStats' fields and episode_s (each episode's seconds)."""

    @property
    def abandoned_tool_calls(self) -> int:
        """This host's timed-out tool calls whose threads may still run."""
        return 0 if self._pool is None else self._pool.abandoned

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def rollout_group(self, engine) -> dist.ProcessGroup | None:
        """A gloo group over the ranks one engine serves (SGLang with rollout TP > 1), else None: every
        DP leader runs its own episodes. Collective on the first call (every rank runs the loop)."""
        r = int(getattr(engine, "group_size", 1) or 1)
        if r <= 1 or self.ps.world_size == 1:
            return None
        if r not in self._groups:
            world = self.ps.world_size
            self._groups[r] = object_group(self.ps, [list(range(k, k + r)) for k in range(0, world, r)])
        return self._groups[r]

    # -- the loop --------------------------------------------------------------------------------

    def run(
        self, engine, prompts: list[list[int]], params: SamplingParams, items: list | None = None
    ) -> list[list[Generation]]:
        """Collective: this rank's prompts -> params.n episodes each, as Generations with
        response_mask and info (module docstring)."""
        self.last_run = None

        def local(flat: list[list[int]], rows: list | None, origins: Origins) -> list[list[Generation]]:
            return self._run_local(engine, flat, rows, origins, params)

        return run_hosted(self.ps, prompts, items, params, self.rollout_group(engine), self.mp, local)

    def _episodes_of(
        self, prompts: list[list[int]], items: list | None, origins: Origins, n: int
    ) -> list[Episode]:
        episodes = []
        for i, p in enumerate(prompts):
            extra = dict(getattr(items[i], "extra_info", None) or {}) if items else {}
            messages = list(getattr(items[i], "messages", None) or []) if items else []
            ikw = clean_row(extra.get("interaction_kwargs") or {})
            name = ikw.get("name") if self.interactions else None
            row = getattr(items[i], "index", i) if items else i
            if self.interactions and name not in self.interactions:
                if len(self.interactions) == 1 and name is None:
                    name = next(iter(self.interactions))
                else:
                    raise ValueError(
                        f"prompt row {row}: extra_info.interaction_kwargs.name={name!r} "
                        f"names none of the interactions {sorted(self.interactions)}"
                    )
            dp, k = origins[i]
            for j in range(n):
                e = Episode(list(p), list(messages), clean_row(extra.get("tools_kwargs") or {}), name, ikw)
                e.where = f"prompt row {row}, sample {j}"
                e.seed_key = (dp, k * n + j)
                episodes.append(e)
        return episodes

    def episodes_of(self, prompt: list[int], item: Any, dp: int, k: int, n: int, step: int) -> list[Episode]:
        """The ``n`` episodes of one prompt, seeded as prompt ``k`` of DP rank ``dp`` at step ``step``
        (partial rollouts: rollout.agent.partial)."""
        episodes = self._episodes_of([prompt], [item] if item is not None else None, [(dp, k)], n)
        for e in episodes:
            e.seed_step = step
        return episodes

    def _run_local(
        self, engine, prompts: list[list[int]], items: list | None, origins: Origins, params: SamplingParams
    ) -> list[list[Generation]]:
        """On the host: every episode of ``prompts`` to its end (module docstring)."""
        episodes = self._episodes_of(prompts, items, origins, params.n)
        self.serve(engine, episodes, params)
        abandoned = self.abandoned_tool_calls
        out = [self.generation(e, params, abandoned) for e in episodes]
        n = params.n
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def serve(
        self,
        engine,
        episodes: list[Episode],
        params: SamplingParams,
        version: int | None = None,
        stop: Callable[[], bool] | None = None,
        ended: Callable[[Episode, int], None] | None = None,
    ) -> None:
        """On the host: ``episodes`` on the engine's turn server, each to its end (or, partial rollouts,
        until ``stop()`` holds when its next turn would go to the engine); ``ended(e, tick)`` at each
        end, tick the server's rounds so far. Sets :attr:`last_run`."""
        if self._pool is None:  # a host that is no DP leader (SGLang's rollout group)
            self._pool = ToolPool(self.cfg.tool_workers, self.cfg.max_abandoned_tool_calls)
        if self.cfg.schedule not in ("async", "lockstep"):
            raise ValueError(
                f"actor_rollout_ref.rollout.multi_turn.schedule={self.cfg.schedule!r}: use async or lockstep"
            )
        server = turn_server(engine)
        server.stop = stop
        if self.cfg.schedule == "lockstep":
            server.live = len(episodes)
        at_end = None if ended is None else (lambda e: ended(e, server.stats.rounds))

        async def main() -> None:
            tasks = [
                asyncio.ensure_future(self.episode(server, e, params, version, at_end)) for e in episodes
            ]
            try:
                await asyncio.gather(*tasks)
            except BaseException:  # the first error stops the others
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        if episodes:
            server.run(main())
        self.last_run = {
            **vars(server.stats),
            "episode_s": [e.run_s for e in episodes if e.finish is not None],
        }

    def generation(self, e: Episode, params: SamplingParams, abandoned: int) -> Generation:
        """An ended episode as a Generation (``abandoned``: this rank's abandoned tool calls now)."""
        info = {
            "num_turns": e.assistant_turns + e.user_turns + 1,  # verl's count: the prompt is a turn
            "assistant_turns": e.assistant_turns,
            "user_turns": e.user_turns,
            **e.stats,
            "tool_rewards": list(e.tool_rewards),
            "turn_scores": list(e.turn_scores),
            "reward_scores": dict(e.reward_scores),
            "tool_reward": sum(e.tool_rewards) + sum(e.reward_scores.values()),
            "abandoned_tool_calls": abandoned,
        }
        lps = list(e.logprobs) if params.return_logprobs else None
        return Generation(
            list(e.tokens), lps, e.finish or "stop", list(e.mask), info, versions=list(e.versions) or None
        )

    async def episode(
        self,
        server,
        e: Episode,
        params: SamplingParams,
        version: int | None = None,
        ended: Callable[[Episode], None] | None = None,
    ) -> None:
        """One episode, turn after turn, to its end; then its tools' rewards. Partial rollouts
        (rollout.agent.partial): its tokens are stamped ``version`` (None: not stamped, the rollout role
        records one version for the batch); it returns unended when the server
        suspends its next turn (``server.stop``), and ``ended(e)`` is called at its end."""
        budget = params.max_new_tokens
        start = time.monotonic()
        step = params.step if e.seed_step is None else e.seed_step
        try:
            while e.finish is None:
                room = budget - len(e.tokens)
                cap = min(room, self.cfg.max_tokens_per_turn) if self.cfg.max_tokens_per_turn else room
                dp, row = e.seed_key
                p1 = replace(params, n=1, max_new_tokens=max(1, cap), step=step)
                turn = e.assistant_turns  # the turns it took so far (in this run or earlier ones)
                try:
                    g = await server.turn(e.prompt + e.tokens, p1, (dp, row + turn * TURN_ROW_STRIDE))
                except Suspended:  # the run stops (partial rollouts): this episode goes on in a later one
                    e.run_s += time.monotonic() - start
                    return
                self._model_turn(e, g, budget, params.return_logprobs)
                if e.finish is None:
                    self._apply(e, await self._environment(e), budget)
                if version is not None:
                    e.versions += [version] * (len(e.tokens) - len(e.versions))
        finally:
            server.leave()
        if ended is not None:
            ended(e)
        await self._final_rewards(e)
        e.run_s += time.monotonic() - start

    def _model_turn(self, e: Episode, g: Generation, budget: int, logprobs: bool) -> None:
        cfg = self.cfg
        room = budget - len(e.tokens)
        toks = list(g.token_ids[:room])
        capped = bool(cfg.max_tokens_per_turn and cfg.max_tokens_per_turn < room)  # the turn's cap binds
        cut = len(toks) < len(g.token_ids) or (g.finish_reason == "length" and not capped)
        e.tokens += toks
        e.mask += [1] * len(toks)
        if logprobs:
            lp = list(g.logprobs or [])[: len(toks)]
            e.logprobs += lp + [math.nan] * (len(toks) - len(lp))
        e.assistant_turns += 1
        text = self.tok.decode(toks, skip_special_tokens=False)
        if e.interaction is not None:
            e.messages.append(
                {"role": "assistant", "content": self.tok.decode(toks, skip_special_tokens=True)}
            )
        if cut or len(e.tokens) >= budget:
            e.finish = "length"
            return
        if cfg.max_assistant_turns and e.assistant_turns >= cfg.max_assistant_turns:
            e.finish = "stop"
            return
        if cfg.max_user_turns is not None and e.user_turns >= cfg.max_user_turns:
            e.finish = "stop"
            return
        fmt = cfg.format
        e.calls = parse_tool_calls(text, fmt) if self.tools or looks_like_a_call(text, fmt) else []
        if not e.calls and e.interaction is None:
            e.finish = "stop"

    # -- tools and interactions (where the episodes run) ------------------------------------------

    def _apply(self, e: Episode, r: dict, budget: int) -> None:
        """The turn's tool replies or user answer appended to ``e`` (or its end)."""
        e.calls = []
        for k, v in r["stats"].items():
            e.stats[k] += v
        e.tool_rewards += r["tool_rewards"]
        e.turn_scores += r["turn_scores"]
        e.messages += r["messages"]
        ids = r["ids"]
        if len(e.tokens) + len(ids) >= budget:
            e.finish = "length"
            return
        e.tokens += ids
        e.mask += [0] * len(ids)
        e.logprobs += [math.nan] * len(ids)
        e.user_turns += 1
        if r["terminate"]:
            e.finish = "stop"

    async def _environment(self, e: Episode) -> dict:
        """Run ``e``'s tool calls (or its interaction): the messages to append and what they scored.
        Calls to one tool run in order in one job (they share its instance); calls to different tools
        run at once. A failing tool is a message to the model naming the tool (and a log line naming
        the episode); a non-finite reward stops the rollout naming the tool and row."""
        cfg, pool = self.cfg, self._pool
        assert pool is not None  # the host of the episodes has the pool
        r: dict = {"stats": {}, "tool_rewards": [], "turn_scores": [], "messages": [], "terminate": False}
        if not e.calls:  # the interaction answers
            out = await wait_job(pool, self._submit_interaction(e), cfg.tool_timeout_s)
            if out[0] != "ok":
                what = "timed out" if out[0] == "timeout" else f"failed: {out[1]}"
                raise RuntimeError(f"interaction {e.interaction!r} {what} on {e.where}")
            terminate, content, score, instance = out[1]
            r["terminate"], e.interaction_id = bool(terminate), instance
            if score is not None:
                where = f"interaction {e.interaction!r} (its turn score) on {e.where}"
                r["turn_scores"].append(finite_reward(score, where, "interaction_config_path"))
            r["messages"].append({"role": "user", "content": clean_text(str(content))})
            r["ids"] = self._encode(r["messages"], e)
            return r
        calls = e.calls[: cfg.max_parallel_calls]
        r["stats"]["dropped_calls"] = len(e.calls) - len(calls)
        replies: list[Any] = [None] * len(calls)  # per call: (status, value)
        by_tool: dict[str, list[int]] = {}
        for k, c in enumerate(calls):
            if c.error is not None:
                replies[k] = ("error", c.error)
            elif c.name not in self.tools:
                known = ", ".join(sorted(self.tools)) or "none"
                replies[k] = ("error", f"no tool named {c.name!r} (tools: {known})")
            else:
                by_tool.setdefault(c.name, []).append(k)
        jobs = [(name, ks, self._submit(e, name, [calls[k] for k in ks])) for name, ks in by_tool.items()]
        outcomes = await asyncio.gather(*(wait_job(pool, f, cfg.tool_timeout_s) for _, _, f in jobs))
        for (name, ks, _), out in zip(jobs, outcomes, strict=True):
            if out[0] == "ok":
                per_call, instance = out[1]
                if instance is not None:
                    e.instances[name] = instance
            else:  # the whole job timed out, was refused or failed outside any call
                per_call = [out] * len(ks)
            for k, reply in zip(ks, per_call, strict=True):
                replies[k] = reply
        failures = []
        st = r["stats"]
        for c, (status, value) in zip(calls, replies, strict=True):
            name = c.name
            st["tool_calls"] = st.get("tool_calls", 0) + 1
            if status == "timeout":
                st["tool_timeouts"] = st.get("tool_timeouts", 0) + 1
                text = f"Error: tool {name!r} timed out after {cfg.tool_timeout_s:g} s"
            elif status == "error":
                st["tool_errors"] = st.get("tool_errors", 0) + 1
                text = f"Error: {value}" if name not in self.tools else f"Error: tool {name!r}: {value}"
            else:
                text, reward = value
                where = f"tool {name!r} (its step reward) on {e.where}"
                r["tool_rewards"].append(finite_reward(reward, where, "tool_config_path"))
            if status != "ok":
                failures.append(text[len("Error: ") :])
            limit, side = cfg.max_tool_response_length, cfg.tool_response_truncate_side
            r["messages"].append({"role": "tool", "content": truncate_text(clean_text(text), limit, side)})
        if failures:
            logger.warning(
                "multi-turn: %d tool call(s) failed on %s; first: %s", len(failures), e.where, failures[0]
            )
        r["ids"] = self._encode(r["messages"], e)
        return r

    def _encode(self, messages: list[dict], e: Episode) -> list[int]:
        """``messages`` as the token ids after ``e``'s turn; a reply the chat template cannot render
        becomes an error message in its place, so a tool's text never stops the rollout."""
        if not messages:
            return []
        last = e.tokens[-1] if e.tokens else None
        try:
            return self.encoder.encode(messages, last)
        except Exception as exc:
            why = f"Error: the reply could not be rendered by the chat template ({type(exc).__name__})"
            logger.warning("multi-turn: %s on %s: %s", why, e.where, exc)
            safe = [{**m, "content": why} for m in messages]
            try:
                return self.encoder.encode(safe, last)
            except Exception as again:
                raise RuntimeError(
                    f"the chat template cannot render a {messages[0]['role']} message on {e.where}: "
                    f"{type(again).__name__}: {again}"
                ) from None

    def _submit(self, e: Episode, name: str, calls: list[ToolCall]) -> ToolFuture[Any]:
        """One job: the episode's calls of tool ``name`` in order, on its instance (created first if the
        episode has none) -> ([(status, (text, reward) | message)], instance id)."""
        tool = self.tools[name]
        kwargs = dict((e.tools_kwargs.get(name) or {}).get("create_kwargs") or {})
        instance = e.instances.get(name)

        def job():
            iid = instance
            if iid is None:
                iid, _ = tl.call(tool.create, create_kwargs=kwargs)
            out = []
            for c in calls:
                try:
                    resp, reward, _ = tl.call(tool.execute, iid, c.arguments)
                    out.append(("ok", (tl.response_text(resp), reward)))
                except Exception as exc:  # the model gets the error as the tool's reply
                    out.append(("error", f"{type(exc).__name__}: {exc}"))
            return out, iid

        return self._timed(job)

    def _submit_interaction(self, e: Episode) -> ToolFuture[Any]:
        assert e.interaction is not None  # an episode with no tool call and no interaction has ended
        inter = self.interactions[e.interaction]
        iid = e.interaction_id
        messages = list(e.messages)
        kwargs = e.interaction_kwargs

        def job():
            i = iid if iid is not None else tl.call(inter.start_interaction, None, **kwargs)
            terminate, content, score, _ = tl.call(inter.generate_response, i, messages, **kwargs)
            return terminate, content, score, i

        return self._timed(job)

    def _timed(self, job: Callable[[], Any]) -> ToolFuture[Any]:
        assert self._pool is not None  # tools and interactions run on the host, which has the pool
        return self._pool.submit(job)  # its future says when the job started (the timeout counts from it)

    async def _final_rewards(self, e: Episode) -> None:
        """{tool: calc_reward} of ``e``, its tool instances released and its interaction finalized; a
        failed calc_reward counts as a tool error."""
        jobs: list[ToolFuture[Any]] = []
        names: list[str | None] = []
        for name, iid in e.instances.items():
            tool = self.tools[name]

            def job(tool=tool, iid=iid):
                try:
                    return tl.call(tool.calc_reward, iid)
                finally:
                    tl.call(tool.release, iid)

            jobs.append(self._timed(job))
            names.append(name)
        if e.interaction_id is not None:
            assert e.interaction is not None  # an interaction id comes from the episode's interaction
            inter = self.interactions[e.interaction]
            iid = e.interaction_id
            jobs.append(self._timed(lambda: tl.call(inter.finalize_interaction, iid)))
            names.append(None)
        if not jobs:
            return
        assert self._pool is not None
        outs = await asyncio.gather(*(wait_job(self._pool, f, self.cfg.tool_timeout_s) for f in jobs))
        for tool_name, out in zip(names, outs, strict=True):
            if tool_name is None:
                continue
            if out[0] == "ok":
                at = f"tool {tool_name!r} (its calc_reward) on {e.where}"
                e.reward_scores[tool_name] = finite_reward(out[1], at, "tool_config_path")
            else:
                e.stats["tool_errors"] += 1
