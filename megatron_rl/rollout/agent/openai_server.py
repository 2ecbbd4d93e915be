"""An OpenAI-compatible chat endpoint on the in-process engine, for agent harnesses that only speak HTTP.

    server = OpenAIServer(engine, tokenizer, params, cfg).start()   # agent_function.py drives it

Each episode gets a session named by its URL prefix, ``http://127.0.0.1:<port>/s/<episode_id>/v1``, and
``agent_fn(item, base_url)`` (the user's harness) runs in a thread, calling
``POST <base_url>/chat/completions`` as often as it likes. Token in, token out:

    first request:  chat template(messages, tools) -> prompt ids        (the session's prompt)
    follow-up:      session ids (prompt + every token so far, as the engine produced them)
                    + the new tool/user messages only, encoded as agent_loop.TurnEncoder encodes them
                    (mask 0)                                            (never a re-tokenised transcript)
    engine.generate -> the model's ids appended (mask 1, with the engine's log-probs)
    reply: chat.completion (content, Hermes tool_calls, finish_reason, usage) + the token ids

Each request is one turn of its episode on the engine's per-episode turn server
(rollout.episode_engine.turn_server), as the built-in agent loop's turns are: SGLang's async requests,
batched continuously by its scheduler; the transformers engine's rounds of whatever turns are pending.
The turn server's loop runs in the thread that owns the engine (:meth:`OpenAIServer.serve`: the caller
of agent_function.run_agent_episodes, or :meth:`OpenAIServer.start`'s thread); HTTP threads hand their
turns to it. Turn t of a session seeded (dp, row) samples with the seed of (dp, row + t * 2**32), the
built-in loop's: its tokens do not depend on which other sessions' turns shared its batch.

Bounds: the server binds a loopback address only; a body larger than ``max_body_bytes`` gets 413 (a
request without a ``Content-Length`` 411, one whose ``Content-Length`` is not a byte count 400);
a request unanswered after ``request_timeout_s`` gets 504 and leaves its session as it was (a late
result is dropped); at most ``max_sessions`` sessions are open at once; a session's response (model +
appended tokens) stops at ``params.max_new_tokens`` (= data.max_response_length), after which every
reply is empty with finish_reason "length". Connections, read time and the shape of a request are
bounded by ``limits`` (openai_request.EndpointLimits; the HTTP side in openai_http.py, the request's
checks in openai_request.py): 4 x max_sessions connections at once, at least 256, one more gets 503;
30 s to deliver a request, else 408 (an idle connection is closed); JSON 64 levels deep, integers of
32 digits, 1024 messages, 128 tool specs, else 400 naming the field. A chat template that cannot
render a request's messages or tools is the request's fault (400).

An engine failure ends the server's service: the failed batch and every request after it get 503
(500 for an error that is not rollout.base.EngineFailure), and :attr:`OpenAIServer.failure` holds the
exception, which agent_function.run_agent_episodes raises. The rollout role then treats it as a failed
``engine.generate`` of the step: an EngineFailure restarts the engine in place (rollout.engine_restarts)
and the step's episodes all run again on a fresh server, the harness called anew for each; anything
else ends the job naming the engine's error.

Sampling is the trainer's (``params``: temperature, top-p/k, stop tokens, seed); a request's
``temperature``/``top_p``/``stop`` are ignored, its ``max_tokens`` / ``max_completion_tokens`` only
lower the turn's cap. The engine must answer ``generate`` on this rank alone (a rollout group of one
rank with TP = PP = 1): the server makes calls other ranks do not mirror.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from megatron_rl.config.rollout_sections import OpenAIServerConfig
from megatron_rl.rollout.agent.episode import TurnEncoder
from megatron_rl.rollout.agent.openai_http import (
    SESSION_PATH,
    EndpointHTTPServer,
    check_endpoint,
    handler_for,
    quiet_http_client_logs,
)
from megatron_rl.rollout.agent.openai_request import (
    EndpointLimits,
    HTTPError,
    check_chat,
    completion,
    rendered,
)
from megatron_rl.rollout.base import EngineDied, EngineFailure, Generation, SamplingParams
from megatron_rl.rollout.episode_engine import TURN_ROW_STRIDE, turn_server

log = logging.getLogger(__name__)

_MAX_ENCODERS = 64  # distinct tool lists whose TurnEncoder is kept (a harness may vary them per session)
_T = TypeVar("_T")


@dataclass
class Session:
    """One episode's record: ``tokens``/``mask``/``logprobs`` are the response after ``prompt``."""

    episode_id: str
    prompt: list[int] | None = None
    """The first request's rendered messages (None until it is answered)."""
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 on the engine's tokens, 0 on appended tool/user tokens."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each model token; NaN on appended tokens."""
    history: list[dict] = field(default_factory=list)
    """The messages the session has seen, the server's replies included (a follow-up must repeat them)."""
    encoder: TurnEncoder | None = None
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    finish: Literal["length"] | None = None
    """"length" once the response budget is spent."""
    last_finish: Literal["stop", "length"] = "stop"
    seed_key: tuple[int, int] = (0, 0)
    """(dp_rank, row) of its episode: with the turn, its seeds (the module docstring)."""
    busy: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def generation(self, with_logprobs: bool) -> Generation:
        info = {
            "num_turns": self.assistant_turns + self.user_turns + 1,  # verl's count, as agent_loop
            "assistant_turns": self.assistant_turns,
            "user_turns": self.user_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": 0,
            "tool_timeouts": 0,
            "dropped_calls": 0,
            "tool_rewards": [],
            "turn_scores": [],
            "reward_scores": {},
            "tool_reward": 0.0,
            "prompt_ids": list(self.prompt or []),
        }
        lps = list(self.logprobs) if with_logprobs else None
        return Generation(list(self.tokens), lps, self.finish or self.last_finish, list(self.mask), info)


class _Request:
    """One chat request's turn: the engine's prompt, the turn's token cap and its seed origin."""

    def __init__(self, prompt: list[int], cap: int, origin: tuple[int, int]) -> None:
        self.prompt, self.cap, self.origin = prompt, cap, origin
        self.done = threading.Event()
        self.result: Generation | None = None
        self.error: tuple[int, str] | None = None
        """(HTTP status, message) when it is refused instead of answered."""
        self.abandoned = False  # timed out before the engine took it: skipped


class OpenAIServer:
    """``POST /s/<episode_id>/v1/chat/completions`` and ``GET [/s/<episode_id>]/v1/models`` on 127.0.0.1.

    :meth:`serve` runs the engine's turn server in the thread that owns the engine, or
    ``start(engine_thread=True)`` in a thread of its own; sessions are opened with :meth:`open_session`
    (a request to an unknown one gets 404).
    """

    def __init__(
        self,
        engine,
        tokenizer,
        params: SamplingParams,
        cfg: OpenAIServerConfig | None = None,
        max_prompt_tokens: int | None = None,
        limits: EndpointLimits | None = None,
    ) -> None:
        """``max_prompt_tokens``: the longest session prompt accepted (data.max_prompt_length in the
        trainer); a longer first request gets 400. ``limits``: openai_request.EndpointLimits (its defaults
        when None)."""
        self.cfg = cfg or OpenAIServerConfig()
        check_endpoint(self.cfg)
        self.limits = limits or EndpointLimits()
        self.limits.check()
        params.check()
        self.engine, self.tok, self.params = engine, tokenizer, params
        self.max_prompt_tokens = max_prompt_tokens
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._encoders: dict[str, TurnEncoder] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the turn server's, while it serves
        self._turns: Any = None
        self._opened = 0
        self._inflight: set[_Request] = set()  # handed to the turn server, not yet answered
        self._serving = threading.Event()  # set while the turn server runs
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failure: BaseException | None = None
        """What the engine raised, once it failed (agent_function.run_agent_episodes raises it)."""
        self._refusal: tuple[int, str] | None = None  # set: every new request gets it
        quiet_http_client_logs()  # the harnesses' client, in this process
        cap = self.limits.connections(self.cfg.max_sessions)
        self._httpd = EndpointHTTPServer((self.cfg.host, self.cfg.port), handler_for(self), cap)
        # the listen backlog holds a burst of the cap's connections (every session's at once) while the
        # accepting thread catches up (the default 5 resets the rest)
        self._httpd.request_queue_size = max(cap, self.cfg.max_sessions, 5)
        try:
            self._httpd.server_bind()
            self._httpd.server_activate()
        except BaseException:
            self._httpd.server_close()
            raise

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def base_url(self, episode_id: str) -> str:
        """The OpenAI ``base_url`` of a session (a client appends /chat/completions)."""
        return f"http://{self.cfg.host}:{self.port}/s/{episode_id}/v1"

    def start(self, engine_thread: bool = False) -> OpenAIServer:
        """Serve HTTP in a daemon thread; with ``engine_thread`` also the engine's turns
        (:meth:`serve`) in one, until :meth:`shutdown`."""
        t = threading.Thread(target=self._httpd.serve_forever, name="openai-http", daemon=True)
        t.start()
        self._threads.append(t)
        if engine_thread:
            e = threading.Thread(target=self._serve_until_stopped, name="openai-engine", daemon=True)
            e.start()
            self._threads.append(e)
            if not self._serving.wait(60):  # requests before the turn server runs would get 503
                raise RuntimeError("the endpoint's engine thread did not start serving within 60 s")
        return self

    def serve(self, main: Coroutine[Any, Any, _T]) -> _T:
        """Run ``main`` on the engine's turn server in this thread (which must own the engine); while it
        runs, the sessions' requests are its turns."""
        turns = turn_server(self.engine)

        async def serving() -> _T:
            with self._lock:
                self._loop, self._turns = asyncio.get_running_loop(), turns
            self._serving.set()
            try:
                return await main
            finally:
                self._serving.clear()
                with self._lock:
                    self._loop = self._turns = None
                    left, self._inflight = self._inflight, set()
                for r in left:  # the turn server stops with them unanswered
                    if not r.done.is_set():
                        r.error = (503, "the endpoint's engine stopped serving")
                        r.done.set()

        return turns.run(serving())

    def _serve_until_stopped(self) -> None:
        async def until_stopped() -> None:
            while not self._stop.is_set():
                await asyncio.sleep(0.05)

        self.serve(until_stopped())

    @property
    def http(self) -> EndpointHTTPServer:
        """The HTTP server (its ``open_connections``, ``refused`` and ``cap``)."""
        return self._httpd

    def shutdown(self) -> None:
        """Stop serving: later requests get 503, the port is closed."""
        self._stop.set()
        self._refuse_all(503, "the endpoint shut down", [])
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- sessions --------------------------------------------------------------------------------

    def open_session(self, episode_id: str | None = None, seed_key: tuple[int, int] | None = None) -> str:
        """A new session; ``seed_key`` (dp_rank, row) picks its turns' seeds (default: the number of
        sessions opened before it, on rank 0)."""
        episode_id = episode_id or uuid.uuid4().hex
        if not SESSION_PATH.match(f"/s/{episode_id}/v1/"):
            raise ValueError(f"episode id {episode_id!r}: use 1-128 of A-Z a-z 0-9 . _ -")
        with self._lock:
            if episode_id in self._sessions:
                raise ValueError(f"session {episode_id!r} is already open")
            if len(self._sessions) >= self.cfg.max_sessions:
                raise RuntimeError(
                    f"{len(self._sessions)} sessions are open, the most the endpoint allows "
                    f"(max_sessions={self.cfg.max_sessions}); close one first"
                )
            self._sessions[episode_id] = Session(episode_id, seed_key=seed_key or (0, self._opened))
            self._opened += 1
        return episode_id

    def close_session(self, episode_id: str) -> Session:
        """Forget the session and return its record; later requests to it get 404."""
        with self._lock:
            s = self._sessions.pop(episode_id)
        with s.lock:
            s.closed = True
        return s

    # -- the engine side -------------------------------------------------------------------------

    async def _turn(self, req: _Request) -> None:
        """On the turn server's loop: one request's turn."""
        try:
            if req.abandoned:  # timed out before its turn began: skipped
                return
            params = replace(self.params, n=1, max_new_tokens=req.cap, return_logprobs=True)
            try:
                g = await self._turns.turn(req.prompt, params, req.origin)
            except EngineDied as exc:  # the engine's worker is gone: what the rollout restarts on
                self._engine_failed(EngineFailure.of(exc), [req])
                return
            except Exception as exc:  # the engine is done: this request and every later one are refused
                self._engine_failed(exc, [req])
                return
            req.result = g
            req.done.set()
        finally:
            with self._lock:
                self._inflight.discard(req)

    def _engine_failed(self, exc: Exception, batch: list[_Request]) -> None:
        """Record the failure for run_agent_episodes and refuse the batch and all later requests: an
        EngineFailure with 503 (the rollout restarts the engine and runs the step's episodes again),
        anything else with 500."""
        self.failure = exc
        restart = isinstance(exc, EngineFailure)
        log.debug("openai endpoint: the engine failed (%s: %s)", type(exc).__name__, exc)
        why = f"the engine failed ({type(exc).__name__}: {exc})"
        if restart:
            why += "; the rollout restarts it and runs this step's episodes again"
        self._refuse_all(503 if restart else 500, why, batch)

    def _refuse_all(self, status: int, why: str, batch: list[_Request]) -> None:
        """From now on every request gets (status, why); so do ``batch`` and the queued ones."""
        with self._lock:
            if self._refusal is None:
                self._refusal = (status, why)
        for r in batch:
            r.error = self._refusal
            r.done.set()

    def _submit(self, req: _Request) -> None:
        """Hand ``req`` to the turn server, or refuse it at once if the endpoint no longer serves (a
        refusal, or no turn server running: 503)."""
        with self._lock:
            loop, refusal = self._loop, self._refusal
            if refusal is None and loop is not None:
                self._inflight.add(req)
                try:
                    asyncio.run_coroutine_threadsafe(self._turn(req), loop)
                    return
                except RuntimeError:  # the loop closed meanwhile
                    self._inflight.discard(req)
            req.error = refusal or (503, "the endpoint's engine is not serving")
        req.done.set()

    # -- the HTTP side ---------------------------------------------------------------------------

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.cfg.model_name, "object": "model", "owned_by": "megatron-rl"}],
        }

    def _encoder(self, tools: list | None) -> TurnEncoder:
        """The TurnEncoder of a tool list, built once (the most recent ``_MAX_ENCODERS`` are kept)."""
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            if key not in self._encoders:
                if len(self._encoders) >= _MAX_ENCODERS:
                    self._encoders.pop(next(iter(self._encoders)))
                self._encoders[key] = TurnEncoder(self.tok, tools)
            return self._encoders[key]

    def chat(self, episode_id: str, body: dict) -> dict:
        """One chat completion for session ``episode_id`` (see the module docstring)."""
        with self._lock:
            s = self._sessions.get(episode_id)
        if s is None:
            raise HTTPError(404, f"no open session {episode_id!r} (sessions are opened by the trainer)")
        if body.get("n", 1) != 1:
            raise HTTPError(400, "n must be 1 (each episode is one conversation)")
        if body.get("stream"):
            raise HTTPError(400, "stream=true is not supported")
        messages, tools = check_chat(body, self.limits)
        budget = self.params.max_new_tokens
        with s.lock:
            if s.closed:
                raise HTTPError(404, f"session {episode_id!r} is closed")
            if s.busy:
                raise HTTPError(409, f"session {episode_id!r} already has a request in flight")
            if s.finish == "length":
                return self._reply(s, [], [], "length")
            if s.prompt is None:  # the first request: the prompt is the rendered conversation
                kw = {"tools": tools} if tools else {}
                template = self.tok.apply_chat_template
                text = rendered(lambda: template(messages, add_generation_prompt=True, tokenize=False, **kw))
                prompt = list(self.tok.encode(text, add_special_tokens=False))
                appended: list[int] = []
                new: list[dict] = messages
                encoder = rendered(lambda: self._encoder(tools))
            else:
                new = self._new_messages(s, messages)
                assert s.encoder is not None  # set with the prompt
                encoder, last = s.encoder, s.tokens[-1] if s.tokens else None
                appended = rendered(lambda: encoder.encode(new, last))
                prompt = s.prompt
                if len(s.tokens) + len(appended) >= budget:  # the reply does not fit (as agent_loop)
                    s.finish = "length"
                    return self._reply(s, [], [], "length")
            if not prompt:
                raise HTTPError(400, "the messages render to no tokens")
            if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
                raise HTTPError(
                    400,
                    f"the messages render to {len(prompt)} tokens, more than data.max_prompt_length="
                    f"{self.max_prompt_tokens}: shorten them or raise data.max_prompt_length",
                )
            room = budget - len(s.tokens) - len(appended)
            cap = room
            for key in ("max_completion_tokens", "max_tokens"):
                if body.get(key) is not None:
                    if not isinstance(body[key], int) or body[key] < 1:
                        raise HTTPError(400, f"{key} must be a positive integer")
                    cap = min(cap, body[key])
            engine_prompt = prompt + s.tokens + appended
            s.busy = True
        dp, row = s.seed_key
        req = _Request(engine_prompt, cap, (dp, row + s.assistant_turns * TURN_ROW_STRIDE))
        self._submit(req)
        answered = req.done.wait(self.cfg.request_timeout_s)
        with s.lock:
            s.busy = False
            if not answered:
                req.abandoned = True  # still queued: skipped; already generating: its result is dropped
                raise HTTPError(
                    504, f"no reply from the engine within request_timeout_s={self.cfg.request_timeout_s:g} s"
                )
            if req.error is not None:
                raise HTTPError(*req.error)
            if s.closed:
                raise HTTPError(404, f"session {episode_id!r} is closed")
            g = req.result
            assert g is not None  # answered without an error
            toks = list(g.token_ids[:cap])
            lps = list(g.logprobs or [])[: len(toks)]
            lps += [math.nan] * (len(toks) - len(lps))
            cut = len(toks) < len(g.token_ids) or g.finish_reason == "length"
            # commit: the appended messages (mask 0) and the model's turn (mask 1), together
            if s.prompt is None:
                s.prompt, s.encoder = prompt, encoder
            else:
                s.user_turns += 1
            s.tokens += appended + toks
            s.mask += [0] * len(appended) + [1] * len(toks)
            s.logprobs += [math.nan] * len(appended) + lps
            s.assistant_turns += 1
            s.last_finish = "length" if cut else "stop"
            if len(s.tokens) >= budget:
                s.finish = "length"
            reply = self._reply(s, toks, engine_prompt, s.last_finish)
            s.history += new + [reply["choices"][0]["message"]]
            s.tool_calls += len(reply["choices"][0]["message"].get("tool_calls") or [])
            return reply

    def _new_messages(self, s: Session, messages: list[dict]) -> list[dict]:
        """The messages after the session's history; the history must come back unchanged (roles, and
        the content of every message but the server's own replies, which clients may reshape)."""
        k = len(s.history)
        for i, (was, now) in enumerate(zip(s.history, messages, strict=False)):
            same = was["role"] == now["role"] and (
                was["role"] == "assistant" or was["content"] == now["content"]
            )
            if not same:
                raise HTTPError(
                    400,
                    f"message {i} differs from what session {s.episode_id!r} saw: a follow-up repeats the "
                    "conversation so far and appends tool/user messages (token in, token out)",
                )
        new = messages[k:]
        if len(messages) < k or not new:
            raise HTTPError(
                400, f"session {s.episode_id!r}: a follow-up appends at least one tool/user message"
            )
        bad = [m["role"] for m in new if m["role"] not in ("tool", "user")]
        if bad:
            raise HTTPError(400, f"a follow-up may append tool and user messages only, got role {bad[0]!r}")
        return new

    def _reply(self, s: Session, toks: list[int], engine_prompt: list[int], finish: str) -> dict:
        ids = (s.episode_id, s.assistant_turns)
        return completion(self.tok, self.cfg.model_name, ids, toks, engine_prompt, finish)
