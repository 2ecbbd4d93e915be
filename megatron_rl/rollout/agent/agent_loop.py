"""The multi-turn agent loop: many episodes at once on the in-process engine, tools and a simulated user
between the model's turns, token in and token out.

    loop = AgentLoop(multi_turn_cfg, ps, tokenizer)              # collective (a gloo twin of the mp group)
    gens = loop.run(engine, prompt_ids, params, items)           # collective; gens[i]: params.n episodes

One turn for every episode still running (all of them in one ``engine.generate`` call):

    prefix = prompt + response so far (token ids)  -> engine.generate (n=1 per episode, the budget left)
    model tokens appended, response_mask 1         -> parse the turn's text for tool calls (hermes)
    tool calls: run in a thread pool, every call of every episode at once, each with a timeout
      (a timeout, an exception or a malformed call becomes the tool message "Error: ...", never a crash)
    or else the interaction (a simulated user) answers the turn
    the new messages as token ids (the chat template's rendering of them after an assistant turn),
    appended with response_mask 0                  -> next turn

An episode ends when a turn has no tool call and no interaction answers it, at
``max_assistant_turns`` / ``max_user_turns``, when an interaction says so, or when its response
(model + tool tokens) reaches ``params.max_new_tokens`` (= data.max_response_length): finish "length".

The training sequence is exactly prompt + the concatenation of what the engine produced and what was
appended: nothing is decoded and re-encoded as a whole. Tools and interactions run only on the DP
leader (tp_rank 0, pp_rank 0); its results go to the TP/PP peers by broadcast, so every rank of a
replica holds the same episodes. Every rank of the world runs the same number of turns (an all-reduce
per turn), as the engines' collectives need.
"""

from __future__ import annotations

import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.errors import LaunchError, NonFiniteRewardError
from megatron_rl.rollout.agent import tools as tl
from megatron_rl.rollout.agent.tool_formats import ToolCall, looks_like_a_call, parse_tool_calls
from megatron_rl.rollout.base import Generation, SamplingParams, gloo_twin

if TYPE_CHECKING:
    from megatron_rl.config.schema import MultiTurnConfig
    from megatron_rl.parallel import ParallelState

logger = logging.getLogger(__name__)
_SURROGATE = re.compile("[\ud800-\udfff]")

_TURN_SEED_STRIDE = 7919  # each turn samples from its own stream
_MARK = "MRLASSISTANTMARK"  # the assistant content of the probe conversation (found again in its text)
T = TypeVar("T")


class ToolRefused(RuntimeError):
    """A call the pool refused at once: too many timed-out calls are still running."""


class ToolFuture(Future[T]):
    """A pool job's Future: when it began running (time.monotonic), whether it returned or was abandoned."""

    started: float | None = None
    finished = False
    abandoned = False


class ToolPool:
    """``workers`` daemon threads running jobs, each returning a Future.

    A Python thread cannot be killed, so a job that runs past its timeout is *abandoned*
    (:meth:`abandon`): its thread stays inside the call and a fresh worker takes its place, up to
    ``workers + max_abandoned`` threads in all. The thread of an abandoned job exits when the job
    returns (the pool is back to ``workers``). With ``max_abandoned`` jobs abandoned and still running,
    :meth:`submit` refuses at once (a :class:`ToolRefused` future), and a queued job that no live
    worker is left to start can be cancelled (:meth:`refuse_queued`): the pool never holds more than
    ``workers + max_abandoned`` threads, however many calls hang.
    """

    def __init__(self, workers: int, max_abandoned: int | None = None) -> None:
        self._jobs: queue.SimpleQueue[tuple[ToolFuture[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.workers = workers
        self.max_abandoned = workers if max_abandoned is None else max_abandoned
        self._threads = 0  # alive: idle, busy or abandoned
        self._abandoned = 0  # of them, inside a job that was abandoned
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name="tool", daemon=True).start()

    @property
    def abandoned(self) -> int:
        """Abandoned jobs whose threads are still running."""
        with self._lock:
            return self._abandoned

    @property
    def threads(self) -> int:
        """Threads of the pool alive (idle, busy or abandoned)."""
        with self._lock:
            return self._threads

    @property
    def live(self) -> int:
        """Threads that take new jobs (not inside an abandoned one)."""
        with self._lock:
            return self._threads - self._abandoned

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                with self._lock:
                    self._threads -= 1
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            fut.started = time.monotonic()
            try:
                result, exc = fn(), None
            except BaseException as e:  # the caller reports it as the tool's error
                result, exc = None, e
            leave = False
            with self._lock:
                fut.finished = True
                if fut.abandoned:
                    # back from an abandoned job: its place went to a fresh worker, so this one goes,
                    # unless the cap left the pool short of workers
                    self._abandoned -= 1
                    leave = self._threads - self._abandoned > self.workers
                    if leave:
                        self._threads -= 1
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)
            if leave:
                return

    def submit(self, fn: Callable[[], T]) -> ToolFuture[T]:
        fut: ToolFuture[T] = ToolFuture()
        if self.abandoned >= self.max_abandoned:
            fut.set_exception(ToolRefused(self.refused()))
            return fut
        self._jobs.put((fut, fn))
        return fut

    def abandon(self, fut: ToolFuture[Any]) -> bool:
        """Stop waiting for ``fut``'s job: its thread runs on, another takes its place while the
        abandoned are fewer than ``max_abandoned``. False when the job has just finished (the caller
        reads its result instead)."""
        with self._lock:
            if fut.finished:
                return False
            if fut.abandoned:
                return True
            fut.abandoned = True
            self._abandoned += 1
            if self._threads < self.workers + self.max_abandoned:
                self._spawn()
            return True

    def refused(self) -> str:
        """The message of a refused call (names the cap's key)."""
        with self._lock:
            stuck = self._abandoned
        return (
            f"refused: {stuck} earlier tool calls timed out and still run "
            f"(multi_turn.max_abandoned_tool_calls={self.max_abandoned})"
        )

    def refuse_queued(self, fut: ToolFuture[Any]) -> bool:
        """Cancel ``fut`` if it has not started and every thread is inside an abandoned job (none is
        left to start it until a hung call returns); True when cancelled."""
        return self.live == 0 and fut.cancel()

    def shutdown(self) -> None:
        """Idle workers exit; an abandoned one exits when its job returns, or with the process."""
        for _ in range(self.threads):
            self._jobs.put(None)


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl's cut of a long tool reply: left keeps the start, right the end, middle both ends."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half) :]


class TurnEncoder:
    """New messages (tool replies, a user's answer) -> the token ids that follow an assistant turn.

    The chat template renders a probe conversation (user, assistant) with and without the new messages
    plus the generation prompt; the difference is the text of the new turn (tool-response markup, the
    next assistant header). What the template writes after the assistant's closing token (Qwen's
    "\\n" after <|im_end|>) is put in front, since the model's turn ended at that token. Only this
    piece is encoded; the tokens of the turns before it are never re-encoded.
    """

    def __init__(self, tokenizer, tool_schemas: list[dict] | None = None) -> None:
        self.tok, self.tools = tokenizer, tool_schemas or None
        self.base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARK}]
        self.base_text = self._render(self.base, False)
        if _MARK not in self.base_text:
            raise ValueError("the tokenizer's chat template does not write the assistant's content")
        self.tail = self.base_text[self.base_text.rindex(_MARK) + len(_MARK) :]
        self._sep: dict[int, str] = {}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        kw = {"tools": self.tools} if self.tools else {}
        return self.tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **kw
        )

    def separator(self, last_token: int | None) -> str:
        """Template text between the model's last token and the next message."""
        if last_token is None:
            return self.tail
        if last_token not in self._sep:
            text = self.tok.decode([last_token], skip_special_tokens=False)
            self._sep[last_token] = (
                self.tail[len(text) :] if text and self.tail.startswith(text) else self.tail
            )
        return self._sep[last_token]

    def encode(self, messages: list[dict], last_token: int | None) -> list[int]:
        full = self._render(self.base + messages, True)
        if not full.startswith(self.base_text):
            raise ValueError(
                "the chat template renders the earlier turns differently once a new message follows; "
                "its turns cannot be appended token by token"
            )
        text = self.separator(last_token) + full[len(self.base_text) :]
        return list(self.tok.encode(text, add_special_tokens=False))


@dataclass
class Episode:
    prompt: list[int]
    messages: list[dict]
    tools_kwargs: dict
    interaction: str | None
    interaction_kwargs: dict
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    finish: Literal["stop", "length"] | None = None
    calls: list[ToolCall] = field(default_factory=list)
    stats: dict[str, float] = field(
        default_factory=lambda: {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "dropped_calls": 0}
    )
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    reward_scores: dict[str, float] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)
    """tool name -> instance id (created at the episode's first call of that tool)."""
    interaction_id: str | None = None
    where: str = "prompt row ?"
    """The episode in error lines: its prompt's data row and sample."""


def _clean(d: Any) -> Any:
    """Parquet structs hold the union of the rows' keys, None where a row had none: drop those."""
    if isinstance(d, dict):
        return {k: _clean(v) for k, v in d.items() if v is not None}
    return d


class AgentLoop:
    """See the module docstring; ``cfg`` is actor_rollout_ref.rollout.multi_turn."""

    def __init__(self, cfg: MultiTurnConfig, ps: ParallelState, tokenizer, tools: dict | None = None) -> None:
        self.cfg, self.ps, self.tok = cfg, ps, tokenizer
        self.leader = ps.is_dp_leader
        if tools is None:
            tools = tl.load_tools(cfg.tool_config_path) if cfg.tool_config_path else {}
        self.tools = tools
        self.interactions = (
            tl.load_interactions(cfg.interaction_config_path) if cfg.interaction_config_path else {}
        )
        schemas = [tl.schema_dict(t.tool_schema) for t in self.tools.values()]
        self.encoder = TurnEncoder(tokenizer, schemas)
        self._mp = gloo_twin(ps, ps.mp_group) if ps.tp_size * ps.pp_size > 1 else None
        self._pool = ToolPool(cfg.tool_workers, cfg.max_abandoned_tool_calls) if self.leader else None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    # -- the loop --------------------------------------------------------------------------------

    def run(
        self, engine, prompts: list[list[int]], params: SamplingParams, items: list | None = None
    ) -> list[list[Generation]]:
        """Collective: this rank's prompts -> params.n episodes each, as Generations with
        response_mask and info (module docstring)."""
        budget = params.max_new_tokens
        episodes = []
        for i, p in enumerate(prompts):
            extra = dict(getattr(items[i], "extra_info", None) or {}) if items else {}
            messages = list(getattr(items[i], "messages", None) or []) if items else []
            ikw = _clean(extra.get("interaction_kwargs") or {})
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
            for j in range(params.n):
                e = Episode(list(p), list(messages), _clean(extra.get("tools_kwargs") or {}), name, ikw)
                e.where = f"prompt row {row}, sample {j}"
                episodes.append(e)
        turn = 0
        while True:
            active = [e for e in episodes if e.finish is None]
            left = max((budget - len(e.tokens) for e in active), default=0)
            sync = torch.tensor([len(active), left], dtype=torch.long, device=self.ps.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(sync, op=dist.ReduceOp.MAX)
            if int(sync[0]) == 0:
                break
            seed = None if params.seed is None else params.seed + _TURN_SEED_STRIDE * turn
            turn_max = max(1, int(sync[1]))
            if self.cfg.max_tokens_per_turn:
                turn_max = min(turn_max, self.cfg.max_tokens_per_turn)
            p1 = replace(params, n=1, max_new_tokens=turn_max, seed=seed)
            gens = engine.generate([e.prompt + e.tokens for e in active], p1)
            for e, (g,) in zip(active, gens, strict=True):
                self._model_turn(e, g, budget, params.return_logprobs)
            self._observe([e for e in active if e.finish is None], budget)
            turn += 1
        self._finish(episodes)
        abandoned = self._pool.abandoned if self._pool is not None else 0
        out = []
        for e in episodes:
            info = {
                "num_turns": e.assistant_turns + e.user_turns + 1,  # verl's count: the prompt is a turn
                "assistant_turns": e.assistant_turns,
                "user_turns": e.user_turns,
                **e.stats,
                "tool_rewards": list(e.tool_rewards),
                "turn_scores": list(e.turn_scores),
                "reward_scores": dict(e.reward_scores),
                "tool_reward": sum(e.tool_rewards) + sum(e.reward_scores.values()),
                "abandoned_tool_calls": abandoned,  # this rank's, when the run ended
            }
            lps = list(e.logprobs) if params.return_logprobs else None
            out.append(Generation(list(e.tokens), lps, e.finish or "stop", list(e.mask), info))
        n = params.n
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

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

    # -- tools and interactions (the DP leader runs them; the peers get the results) ---------------

    def _observe(self, eps: list[Episode], budget: int) -> None:
        """Every waiting episode gets its tool replies or its user's answer appended (or ends)."""
        results: list[tl.TurnResult] | tuple[bool, str] | None = None
        if self.leader:
            try:
                results = self._environment(eps)
            except Exception as exc:  # the TP/PP peers must not wait forever for the results
                results = _failure(exc)
        if self._mp is not None:
            box = [results]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._mp, 0), group=self._mp)
            results = box[0]
        if isinstance(results, tuple):
            _raise(results)
        assert results is not None  # the leader's, computed above or received by broadcast
        for e, r in zip(eps, results, strict=True):
            e.calls = []
            for k, v in r["stats"].items():
                e.stats[k] += v
            e.tool_rewards += r["tool_rewards"]
            e.turn_scores += r["turn_scores"]
            e.messages += r["messages"]
            if r.get("instances"):
                e.instances.update(r["instances"])
            if r.get("interaction_id"):
                e.interaction_id = r["interaction_id"]
            ids = r["ids"]
            if len(e.tokens) + len(ids) >= budget:
                e.finish = "length"
                continue
            e.tokens += ids
            e.mask += [0] * len(ids)
            e.logprobs += [math.nan] * len(ids)
            e.user_turns += 1
            if r["terminate"]:
                e.finish = "stop"

    def _environment(self, eps: list[Episode]) -> list[tl.TurnResult]:
        """Run the tools / interactions of ``eps``: per episode, the messages to append and what they
        scored. Calls of one episode to one tool run in order in one job (they share its instance);
        everything else runs at once. A failing tool is a message to the model naming the tool (and a
        log line naming the episode); a non-finite reward stops the rollout naming the tool and row."""
        cfg = self.cfg
        results: list[tl.TurnResult] = [
            {"stats": {}, "tool_rewards": [], "turn_scores": [], "messages": [], "terminate": False}
            for _ in eps
        ]
        replies: list[list] = [[] for _ in eps]  # per episode, per call: (status, value)
        names: list[list[str]] = [[] for _ in eps]  # per episode, per call: the tool called
        jobs: list[tuple[int, list[int], ToolFuture[Any]]] = []  # (episode, its call positions, future)
        for i, e in enumerate(eps):
            if not e.calls:
                jobs.append((i, [], self._submit_interaction(e)))
                continue
            calls = e.calls[: cfg.max_parallel_calls]
            results[i]["stats"]["dropped_calls"] = len(e.calls) - len(calls)
            replies[i] = [None] * len(calls)
            names[i] = [c.name for c in calls]
            by_tool: dict[str, list[int]] = {}
            for k, c in enumerate(calls):
                if c.error is not None:
                    replies[i][k] = ("error", c.error)
                elif c.name not in self.tools:
                    known = ", ".join(sorted(self.tools)) or "none"
                    replies[i][k] = ("error", f"no tool named {c.name!r} (tools: {known})")
                else:
                    by_tool.setdefault(c.name, []).append(k)
            for name, ks in by_tool.items():
                jobs.append((i, ks, self._submit(e, name, [calls[k] for k in ks])))
        outcomes = self._collect([j[2] for j in jobs])
        for (i, ks, _), out in zip(jobs, outcomes, strict=True):
            e, r = eps[i], results[i]
            if not ks:  # the interaction
                if out[0] != "ok":
                    what = "timed out" if out[0] == "timeout" else f"failed: {out[1]}"
                    raise RuntimeError(f"interaction {e.interaction!r} {what} on {e.where}")
                terminate, content, score, instance = out[1]
                r["terminate"], r["interaction_id"] = bool(terminate), instance
                e.interaction_id = instance
                if score is not None:
                    where = f"interaction {e.interaction!r} (its turn score) on {e.where}"
                    r["turn_scores"].append(finite_reward(score, where, "interaction_config_path"))
                r["messages"].append({"role": "user", "content": clean_text(str(content))})
                continue
            if out[0] == "ok":
                per_call, instance = out[1]
                if instance is not None:
                    e.instances[eps[i].calls[ks[0]].name] = instance
                    r.setdefault("instances", {})[eps[i].calls[ks[0]].name] = instance
            else:  # the whole job timed out, was refused or failed outside any call
                per_call = [out] * len(ks)
            for k, reply in zip(ks, per_call, strict=True):
                replies[i][k] = reply
        failures = []
        for i, r in enumerate(results):
            st = r["stats"]
            for name, (status, value) in zip(names[i], replies[i], strict=True):
                st["tool_calls"] = st.get("tool_calls", 0) + 1
                if status == "timeout":
                    st["tool_timeouts"] = st.get("tool_timeouts", 0) + 1
                    text = f"Error: tool {name!r} timed out after {cfg.tool_timeout_s:g} s"
                elif status == "error":
                    st["tool_errors"] = st.get("tool_errors", 0) + 1
                    text = f"Error: {value}" if name not in self.tools else f"Error: tool {name!r}: {value}"
                else:
                    text, reward = value
                    where = f"tool {name!r} (its step reward) on {eps[i].where}"
                    r["tool_rewards"].append(finite_reward(reward, where, "tool_config_path"))
                if status != "ok":
                    failures.append(f"{text[len('Error: ') :]} ({eps[i].where})")
                limit, side = cfg.max_tool_response_length, cfg.tool_response_truncate_side
                r["messages"].append(
                    {"role": "tool", "content": truncate_text(clean_text(text), limit, side)}
                )
        if failures:
            logger.warning(
                "multi-turn: %d tool call(s) failed this turn; first: %s", len(failures), failures[0]
            )
        for r, e in zip(results, eps, strict=True):
            r["ids"] = self._encode(r["messages"], e)
        return results

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
        assert self._pool is not None  # tools and interactions run on the DP leader, which has the pool
        return self._pool.submit(job)  # its future says when the job started (the timeout counts from it)

    def _collect(self, items: list[ToolFuture[Any]]) -> list[tuple[str, Any]]:
        """Wait for the futures, each up to tool_timeout_s from when it started running. A timed-out
        job is abandoned to the pool (its thread runs on, its result is dropped); a job the pool refused
        (:class:`ToolPool`'s cap) comes back at once as an error."""
        limit, pool = self.cfg.tool_timeout_s, self._pool
        assert pool is not None  # only the DP leader runs jobs, and it has the pool
        out: dict[int, tuple[str, Any]] = {}
        pending = set(range(len(items)))
        while pending:
            now = time.monotonic()
            for i in list(pending):
                f = items[i]
                if f.done() and not f.cancelled():
                    exc = f.exception()
                    if exc is None:
                        out[i] = ("ok", f.result())
                    elif isinstance(exc, ToolRefused):
                        out[i] = ("error", str(exc))
                    else:
                        out[i] = ("error", f"{type(exc).__name__}: {exc}")
                    pending.discard(i)
                elif f.started is not None and now - f.started > limit:
                    if pool.abandon(f):  # else it has just finished: read on the next pass
                        out[i] = ("timeout", None)
                        pending.discard(i)
                elif f.started is None and pool.refuse_queued(f):
                    out[i] = ("error", pool.refused())
                    pending.discard(i)
            if pending:
                starts = [items[i].started for i in pending]
                nearest = min((s + limit - now for s in starts if s is not None), default=limit)
                if pool.live == 0:  # queued jobs wait for no one: look again soon
                    nearest = min(nearest, 0.05)
                wait([items[i] for i in pending], timeout=max(0.001, nearest), return_when=FIRST_COMPLETED)
        return [out[i] for i in range(len(items))]

    def _finish(self, episodes: list[Episode]) -> None:
        """calc_reward and release of every tool instance, finalize of every interaction (leader),
        then the rewards to the peers (or, when one is not finite, the error: every peer raises it)."""
        scores: list[dict[str, float]] | tuple[bool, str] | None = None
        if self.leader:
            try:
                scores = self._final_rewards(episodes)
            except Exception as exc:  # the TP/PP peers must not wait forever for the rewards
                scores = _failure(exc)
        if self._mp is not None:
            box = [(scores, [e.stats for e in episodes])]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._mp, 0), group=self._mp)
            scores, stats = box[0]
            for e, s in zip(episodes, stats, strict=True):
                e.stats = s
        if isinstance(scores, tuple):
            _raise(scores)
        assert scores is not None  # the leader's, computed above or received by broadcast
        for e, s in zip(episodes, scores, strict=True):
            e.reward_scores = s

    def _final_rewards(self, episodes: list[Episode]) -> list[dict[str, float]]:
        """Per episode, {tool: calc_reward} (leader); a failed calc_reward counts as a tool error."""
        jobs: list[ToolFuture[Any]] = []
        where: list[tuple[int, str | None]] = []
        for k, e in enumerate(episodes):
            for name, iid in e.instances.items():
                tool = self.tools[name]

                def job(tool=tool, iid=iid):
                    try:
                        return tl.call(tool.calc_reward, iid)
                    finally:
                        tl.call(tool.release, iid)

                jobs.append(self._timed(job))
                where.append((k, name))
            if e.interaction_id is not None:
                assert e.interaction is not None  # an interaction id comes from the episode's interaction
                inter = self.interactions[e.interaction]
                jobs.append(self._timed(partial(tl.call, inter.finalize_interaction, e.interaction_id)))
                where.append((k, None))
        scores: list[dict[str, float]] = [{} for _ in episodes]
        for (k, tool_name), out in zip(where, self._collect(jobs), strict=True):
            if tool_name is None:
                continue
            if out[0] == "ok":
                at = f"tool {tool_name!r} (its calc_reward) on {episodes[k].where}"
                scores[k][tool_name] = finite_reward(out[1], at, "tool_config_path")
            else:
                episodes[k].stats["tool_errors"] += 1
        return scores


def _failure(exc: Exception) -> tuple[bool, str]:
    """The leader's failure as it travels to the peers: (one-line LaunchError?, message)."""
    if isinstance(exc, LaunchError):
        return True, str(exc)
    return False, f"{type(exc).__name__}: {exc}"


def _raise(failure: tuple[bool, str]) -> NoReturn:
    """Raise the leader's failure on every rank of the replica."""
    launch, message = failure
    if launch:
        raise LaunchError(message)
    raise RuntimeError(f"multi-turn rollout: {message}")


def clean_text(text: str) -> str:
    """``text`` as valid UTF-8: each lone surrogate (which no tokenizer encodes) becomes U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def finite_reward(value: Any, where: str, key: str) -> float:
    """``value`` (None: 0) as a finite float, else a NonFiniteRewardError naming ``where`` and the key
    of what produced it (``multi_turn.<key>``): a NaN or inf reward would void a whole update."""
    try:
        reward = float(value or 0.0)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        raise NonFiniteRewardError(
            f"{where} returned {value!r}, not a finite number; fix what "
            f"actor_rollout_ref.rollout.multi_turn.{key} loads (a reward must be a finite number)"
        )
    return reward


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------

_SUMS = ("tool_calls", "tool_errors", "tool_timeouts", "dropped_calls")


class EpisodeStats:
    """Accumulates episodes of a step; :meth:`pop` reduces them over the data-parallel group."""

    def __init__(self) -> None:
        self.turns: list[float] = []
        self.sums = dict.fromkeys(_SUMS, 0.0)
        self.length_ended = 0.0
        self.abandoned = 0.0  # timed-out tool calls still running on this rank (the latest run's)

    def add(self, gens: list[list[Generation]]) -> None:
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
        running on one rank); the same keys on every rank (episodes of every DP rank)."""
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
        return out
