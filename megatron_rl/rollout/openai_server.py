"""An OpenAI-compatible chat endpoint on the in-process engine, for agent harnesses that only speak HTTP.

    server = OpenAIServer(engine, tokenizer, params, cfg).start()   # rollout/agent_function.py drives it

Each episode gets a session named by its URL prefix, ``http://127.0.0.1:<port>/s/<episode_id>/v1``, and
``agent_fn(item, base_url)`` (the user's harness) runs in a thread, calling
``POST <base_url>/chat/completions`` as often as it likes. Token in, token out:

    first request:  chat template(messages, tools) -> prompt ids        (the session's prompt)
    follow-up:      session ids (prompt + every token so far, as the engine produced them)
                    + the new tool/user messages only, encoded as agent_loop.TurnEncoder encodes them
                    (mask 0)                                            (never a re-tokenised transcript)
    engine.generate -> the model's ids appended (mask 1, with the engine's log-probs)
    reply: chat.completion (content, Hermes tool_calls, finish_reason, usage) + the token ids

Requests of all sessions go through one queue; the thread that owns the engine (the caller of
agent_function.run_agent_episodes, or :meth:`OpenAIServer.start`'s thread) takes what is waiting, up to
``max_batch`` requests, gathered for ``batch_window_s`` after the first, and answers them with one
``engine.generate`` call. ``engine.generate`` is only ever called from that thread.

Bounds: the server binds a loopback address only; a body larger than ``max_body_bytes`` gets 413 (a
request without a ``Content-Length`` 411, one whose ``Content-Length`` is not a byte count 400);
a request unanswered after ``request_timeout_s`` gets 504 and leaves its session as it was (a late
result is dropped); at most ``max_sessions`` sessions are open at once; a session's response (model +
appended tokens) stops at ``params.max_new_tokens`` (= data.max_response_length), after which every
reply is empty with finish_reason "length".

Sampling is the trainer's (``params``: temperature, top-p/k, stop tokens, seed); a request's
``temperature``/``top_p``/``stop`` are ignored, its ``max_tokens`` / ``max_completion_tokens`` only
lower the turn's cap. The engine must answer ``generate`` on this rank alone (a rollout group of one
rank with TP = PP = 1): the server makes calls other ranks do not mirror.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import queue
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from megatron_rl.config.schema import OpenAIServerConfig
from megatron_rl.rollout.agent_loop import TurnEncoder
from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.rollout.tool_formats import TOOL_CALL, parse_hermes

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

_TURN_SEED_STRIDE = 7919  # each engine call samples from its own stream (as agent_loop's turns do)
_SESSION_ID = re.compile(r"^/s/([A-Za-z0-9._-]{1,128})(/v1/.*)$")


_KEY = "actor_rollout_ref.rollout.multi_turn.endpoint"
_HTTP_CLIENT_LOGGERS = ("httpx", "httpcore")
"""The loggers of the HTTP client under the ``openai`` package: httpx logs every request at INFO."""


def quiet_http_client_logs() -> None:
    """Keep the HTTP client's loggers (:data:`_HTTP_CLIENT_LOGGERS`) at WARNING: an ``openai`` harness
    makes a request per turn, and the trainer's INFO console would print a line for each. Left as they
    are when the user asked for more: the root logger at DEBUG, or a level of their own set on them."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    for name in _HTTP_CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def check_endpoint(cfg: OpenAIServerConfig) -> None:
    """The endpoint binds a loopback address only and its bounds are positive (config/checks.py checks
    the same keys of a loaded config; this guards a server built directly)."""
    try:
        loopback = ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"{_KEY}.host={cfg.host!r} is not a loopback address; the endpoint has no "
            "authentication, so it binds 127.0.0.1 only: set host to 127.0.0.1"
        )
    for key in ("max_body_bytes", "max_sessions", "max_batch"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{_KEY}.{key}={getattr(cfg, key)} must be >= 1")
    for key in ("request_timeout_s", "episode_timeout_s"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{_KEY}.{key}={getattr(cfg, key)} must be > 0")
    if cfg.batch_window_s < 0:
        raise ValueError(f"{_KEY}.batch_window_s={cfg.batch_window_s} must be >= 0")


class HTTPError(Exception):
    """A request refused with ``status`` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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
    finish: str | None = None
    """"length" once the response budget is spent."""
    last_finish: str = "stop"
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
    """One queued chat request: the engine's prompt and the turn's token cap."""

    def __init__(self, prompt: list[int], cap: int) -> None:
        self.prompt, self.cap = prompt, cap
        self.done = threading.Event()
        self.result: Generation | None = None
        self.error: str | None = None
        self.abandoned = False  # timed out before the engine took it: skipped


def _text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of {"type": "text", "text"} parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text":
                raise HTTPError(400, "only text message content is supported (parts of type 'text')")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise HTTPError(
        400, f"message content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _normalise(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list of chat messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, "every message is an object with a 'role'")
        out.append({**m, "content": _text(m.get("content"))})
    return out


class OpenAIServer:
    """``POST /s/<episode_id>/v1/chat/completions`` and ``GET [/s/<episode_id>]/v1/models`` on 127.0.0.1.

    ``pump`` (one batch) must be called by the thread that owns the engine, or ``start(engine_thread=
    True)`` runs it in a thread of its own; sessions are opened with :meth:`open_session` (a request
    to an unknown one gets 404).
    """

    def __init__(
        self,
        engine,
        tokenizer,
        params: SamplingParams,
        cfg: OpenAIServerConfig | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        """``max_prompt_tokens``: the longest session prompt accepted (data.max_prompt_length in the
        trainer); a longer first request gets 400."""
        self.cfg = cfg or OpenAIServerConfig()
        check_endpoint(self.cfg)
        params.check()
        self.engine, self.tok, self.params = engine, tokenizer, params
        self.max_prompt_tokens = max_prompt_tokens
        self._queue: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._encoders: dict[str, TurnEncoder] = {}
        self._calls = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        quiet_http_client_logs()  # the harnesses' client, in this process
        self._httpd = _HTTPServer((self.cfg.host, self.cfg.port), _handler(self), False)
        self._httpd.daemon_threads = True
        # the listen backlog holds every session's connection at once (the default 5 resets the rest)
        self._httpd.request_queue_size = max(self.cfg.max_sessions, 5)
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
        """Serve HTTP in a daemon thread; with ``engine_thread`` also run :meth:`pump` in one."""
        t = threading.Thread(target=self._httpd.serve_forever, name="openai-http", daemon=True)
        t.start()
        self._threads.append(t)
        if engine_thread:
            e = threading.Thread(target=self._pump_forever, name="openai-engine", daemon=True)
            e.start()
            self._threads.append(e)
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- sessions --------------------------------------------------------------------------------

    def open_session(self, episode_id: str | None = None) -> str:
        episode_id = episode_id or uuid.uuid4().hex
        if not _SESSION_ID.match(f"/s/{episode_id}/v1/"):
            raise ValueError(f"episode id {episode_id!r}: use 1-128 of A-Z a-z 0-9 . _ -")
        with self._lock:
            if episode_id in self._sessions:
                raise ValueError(f"session {episode_id!r} is already open")
            if len(self._sessions) >= self.cfg.max_sessions:
                raise RuntimeError(
                    f"{len(self._sessions)} sessions are open, the most the endpoint allows "
                    f"(max_sessions={self.cfg.max_sessions}); close one first"
                )
            self._sessions[episode_id] = Session(episode_id)
        return episode_id

    def close_session(self, episode_id: str) -> Session:
        """Forget the session and return its record; later requests to it get 404."""
        with self._lock:
            s = self._sessions.pop(episode_id)
        with s.lock:
            s.closed = True
        return s

    # -- the engine side -------------------------------------------------------------------------

    def _pump_forever(self) -> None:
        while not self._stop.is_set():
            self.pump(0.1)

    def pump(self, wait_s: float) -> int:
        """Answer one batch: wait up to ``wait_s`` for a request, gather more for ``batch_window_s``
        (at most ``max_batch``), run one ``engine.generate``. Returns the number of requests answered."""
        try:
            batch = [self._queue.get(timeout=wait_s)]
        except queue.Empty:
            return 0
        deadline = time.monotonic() + self.cfg.batch_window_s
        while len(batch) < self.cfg.max_batch:
            left = deadline - time.monotonic()
            try:
                batch.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        live = [r for r in batch if not r.abandoned]
        if not live:
            return 0
        p = self.params
        seed = None if p.seed is None else p.seed + _TURN_SEED_STRIDE * self._calls
        self._calls += 1
        call = replace(p, n=1, max_new_tokens=max(r.cap for r in live), seed=seed, return_logprobs=True)
        try:
            gens = self.engine.generate([r.prompt for r in live], call)
            if len(gens) != len(live):
                raise RuntimeError(f"engine returned {len(gens)} results for {len(live)} prompts")
        except Exception as exc:  # every request of the batch gets the error; the server goes on
            for r in live:
                r.error = f"engine error: {type(exc).__name__}: {exc}"
                r.done.set()
            return len(live)
        for r, (g,) in zip(live, gens, strict=True):
            r.result = g
            r.done.set()
        return len(live)

    # -- the HTTP side ---------------------------------------------------------------------------

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.cfg.model_name, "object": "model", "owned_by": "megatron-rl"}],
        }

    def _encoder(self, tools: list | None) -> TurnEncoder:
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            if key not in self._encoders:
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
        messages = _normalise(body.get("messages"))
        tools = body.get("tools") or None
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
                text = self.tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False, **kw
                )
                prompt = list(self.tok.encode(text, add_special_tokens=False))
                appended: list[int] = []
                new: list[dict] = messages
                encoder = self._encoder(tools)
            else:
                new = self._new_messages(s, messages)
                encoder = s.encoder
                appended = encoder.encode(new, s.tokens[-1] if s.tokens else None)
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
        req = _Request(engine_prompt, cap)
        self._queue.put(req)
        answered = req.done.wait(self.cfg.request_timeout_s)
        with s.lock:
            s.busy = False
            if not answered:
                req.abandoned = True  # still queued: skipped; already generating: its result is dropped
                raise HTTPError(
                    504, f"no reply from the engine within request_timeout_s={self.cfg.request_timeout_s:g} s"
                )
            if req.error is not None:
                raise HTTPError(500, req.error)
            if s.closed:
                raise HTTPError(404, f"session {episode_id!r} is closed")
            g = req.result
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
        text = self.tok.decode(toks, skip_special_tokens=False)
        calls = parse_hermes(text)
        tool_calls, spans = [], []
        for k, (m, c) in enumerate(zip(TOOL_CALL.finditer(text), calls, strict=True)):
            if c.error is not None:
                continue  # a malformed call stays in the content, as text
            spans.append(m.span())
            tool_calls.append(
                {
                    "id": f"call_{s.episode_id}_{s.assistant_turns}_{k}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
            )
        kept = text
        for a, b in reversed(spans):
            kept = kept[:a] + kept[b:]
        # the content without special tokens: the model's text as a chat client expects it
        special = [t for t in self.tok.all_special_tokens if t]
        for t in special:
            kept = kept.replace(t, "")
        message: dict[str, Any] = {
            "role": "assistant",
            "content": kept.strip() or (None if tool_calls else ""),
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "id": f"chatcmpl-{s.episode_id}-{s.assistant_turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.cfg.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if tool_calls else finish,
                    "logprobs": None,
                    "token_ids": list(toks),  # the engine's ids of this turn
                }
            ],
            "usage": {
                "prompt_tokens": len(engine_prompt),
                "completion_tokens": len(toks),
                "total_tokens": len(engine_prompt) + len(toks),
            },
            "prompt_token_ids": list(engine_prompt),  # what the engine was given
        }


class _HTTPServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a harness's timeout, a killed harness) is routine: one debug line, not
        socketserver's traceback on stderr. Anything else keeps the traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):  # BrokenPipeError, ConnectionResetError, ...
            log.debug("openai endpoint: client %s hung up (%s: %s)", client_address, type(exc).__name__, exc)
            return
        super().handle_error(request, client_address)


def _handler(server: OpenAIServer) -> type[BaseHTTPRequestHandler]:
    cfg = server.cfg

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = cfg.request_timeout_s  # a client that stops sending does not hold a thread forever

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the trainer's log is elsewhere
            pass

        def _send(self, status: int, obj: dict, close: bool = False) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, close: bool = False) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._send(status, {"error": {"message": message, "type": kind, "code": status}}, close)

        def _route(self) -> tuple[str | None, str]:
            path = self.path.split("?", 1)[0]
            m = _SESSION_ID.match(path)
            return (m.group(1), m.group(2)) if m else (None, path)

        def do_GET(self) -> None:
            _, rest = self._route()
            if rest.rstrip("/") == "/v1/models":
                self._send(200, server.models())
            else:
                self._error(404, f"no route GET {self.path}")

        def do_POST(self) -> None:
            episode, rest = self._route()
            length = self.headers.get("Content-Length")
            if length is None:
                self._error(411, "a request needs a Content-Length header (chunked bodies are refused)", True)
                return
            if not (length.isascii() and length.isdigit()):  # str.isdigit alone takes "²" and "١"
                self._error(400, f"Content-Length {length[:40]!r} is not a byte count", True)
                return
            n = int(length)
            if n > cfg.max_body_bytes:
                self._drain(n)
                self._error(
                    413, f"request body of {n} bytes is over max_body_bytes={cfg.max_body_bytes}", True
                )
                return
            raw = self.rfile.read(n)
            if rest.rstrip("/") != "/v1/chat/completions":
                self._error(404, f"no route POST {self.path}")
                return
            if episode is None:
                self._error(404, "requests name their episode: POST /s/<episode_id>/v1/chat/completions")
                return
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise HTTPError(400, "the request body is a JSON object")
                self._send(200, server.chat(episode, body))
            except json.JSONDecodeError as exc:
                self._error(400, f"the request body is not JSON ({exc.msg})")
            except HTTPError as exc:
                self._error(exc.status, str(exc))
            except ConnectionError:  # the client hung up: no one to answer (the server logs one line)
                raise
            except Exception as exc:  # a bug must not kill the handler thread silently
                self._error(500, f"{type(exc).__name__}: {exc}")

        def _drain(self, n: int) -> None:
            """Read (and drop) a bounded part of a refused body, so the client gets the reply rather than
            a reset connection."""
            left = min(n, 4 * cfg.max_body_bytes)
            try:
                while left > 0:
                    chunk = self.rfile.read(min(left, 65536))
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:
                pass

    return Handler


# --------------------------------------------------------------------------------------------------
# Episodes run by the user's harness
# --------------------------------------------------------------------------------------------------
