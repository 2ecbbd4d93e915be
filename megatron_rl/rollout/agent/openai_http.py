"""The HTTP side of the OpenAI-compatible endpoint (rollout/agent/openai_server.py): the socket server and its
request handler (the request's checks and the reply's shape: openai_request.py).

    httpd = EndpointHTTPServer((host, port), handler_for(app), cap)   # app: the OpenAIServer

The limits of the connections (openai_request.EndpointLimits, its defaults); a client's fault gets a
4xx and at most one DEBUG line, never a traceback:

    max_connections  connections served at once, one handler thread each (default: 4 x max_sessions, at
                     least 256). One more is answered 503 by the accepting thread and closed: no thread
                     (the first such refusal is a WARNING line, the rest DEBUG).
    read_timeout_s   30 s for a connection to deliver a whole request (request line, headers, body),
                     counted from when the server starts waiting for it (the connection's opening or its
                     previous reply). Bytes trickled in one at a time (slowloris) do not extend it; a
                     partial request then gets 408, an idle keep-alive connection is closed. A reply the
                     client does not read within it is dropped with the connection.
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import math
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megatron_rl.config.rollout_sections import OpenAIServerConfig
from megatron_rl.rollout.agent.openai_request import HTTPError, parse_body

log = logging.getLogger("megatron_rl.rollout.agent.openai_server")  # one logger for the whole endpoint

SESSION_PATH = re.compile(r"^/s/([A-Za-z0-9._-]{1,128})(/v1/.*)$")
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
    for key in ("max_body_bytes", "max_sessions"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{_KEY}.{key}={getattr(cfg, key)} must be >= 1")
    for key in ("request_timeout_s", "episode_timeout_s"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{_KEY}.{key}={getattr(cfg, key)} must be > 0")


# -- the connections -----------------------------------------------------------------------------------


def raw_reply(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error reply that closes the connection (for a request never parsed)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _DeadlineReads(io.RawIOBase):
    """A connection's reads, each with the time left until ``deadline`` as its socket timeout: a request
    must arrive whole by then, however its bytes trickle in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline, self.received, self.expired = math.inf, 0, False

    def start(self, seconds: float) -> None:
        self.deadline, self.received, self.expired = time.monotonic() + seconds, 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("read_timeout_s passed")
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buf)
        except TimeoutError:
            self.expired = True
            raise
        self.received += n
        return n


class EndpointHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``limits.connections(max_sessions)`` of them; one more connection
    is answered 503 by the accepting thread and closed."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, cap: int) -> None:
        super().__init__(address, handler, bind_and_activate=False)
        self.cap = cap
        self._count_lock = threading.Lock()
        self.open_connections = 0
        """Connections with a handler thread now."""
        self.refused = 0
        """Connections answered 503 over the server's life."""

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self.open_connections >= self.cap
            if not full:
                self.open_connections += 1
        if full:
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._count_lock:
            self.open_connections -= 1

    def _refuse(self, request: socket.socket, client_address: Any) -> None:
        """503 and close, without blocking the accepting thread: what the client already sent is read
        first (closing on unread bytes resets the connection, which may discard the reply)."""
        self.refused += 1
        line = "openai endpoint: %d connections are open (the cap); refusing %s with 503 (%d refused so far)"
        (log.warning if self.refused == 1 else log.debug)(line, self.cap, client_address, self.refused)
        msg = f"the endpoint serves {self.cap} connections at once; retry later (close idle connections)"
        try:
            request.setblocking(False)
            request.send(raw_reply(503, "Service Unavailable", msg))
            request.recv(65536)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a harness's timeout, a killed harness) is routine: one debug line, not
        socketserver's traceback on stderr. Anything else keeps the traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):  # BrokenPipeError, ConnectionResetError, ...
            log.debug("openai endpoint: client %s hung up (%s: %s)", client_address, type(exc).__name__, exc)
            return
        super().handle_error(request, client_address)


def handler_for(app: Any) -> type[BaseHTTPRequestHandler]:
    """The request handler of ``app`` (an OpenAIServer: ``cfg``, ``limits``, ``chat``, ``models``)."""
    cfg, limits = app.cfg, app.limits

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the reads go through the deadline instead
            self._reads = _DeadlineReads(self.connection)
            self.rfile = io.BufferedReader(self._reads)

        def handle_one_request(self) -> None:
            """One request, read within read_timeout_s: a partial one past it gets 408, an idle
            connection is closed."""
            self._reads.start(limits.read_timeout_s)
            self._answered = False
            super().handle_one_request()
            if self._reads.expired:
                self.close_connection = True
                if self._reads.received and not self._answered:
                    log.debug(
                        "openai endpoint: %s sent part of a request in read_timeout_s", self.client_address
                    )
                    msg = f"the request did not arrive whole within read_timeout_s={limits.read_timeout_s:g}"
                    self.connection.settimeout(limits.read_timeout_s)
                    self.wfile.write(raw_reply(408, "Request Timeout", msg))

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the trainer's log is elsewhere
            pass

        def _send(self, status: int, obj: dict, close: bool = False) -> None:
            data = json.dumps(obj).encode()
            self._answered = True
            self.connection.settimeout(limits.read_timeout_s)  # a client that does not read its reply
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, close: bool = False) -> None:
            if status < 500:
                log.debug("openai endpoint: %s %s: %d %s", self.command, self.path[:200], status, message)
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._send(status, {"error": {"message": message, "type": kind, "code": status}}, close)

        def _route(self) -> tuple[str | None, str]:
            path = self.path.split("?", 1)[0]
            m = SESSION_PATH.match(path)
            return (m.group(1), m.group(2)) if m else (None, path)

        def do_GET(self) -> None:
            _, rest = self._route()
            if rest.rstrip("/") == "/v1/models":
                self._send(200, app.models())
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
            if len(raw) < n:  # the client closed its side mid-body
                self.close_connection = True
                return
            if rest.rstrip("/") != "/v1/chat/completions":
                self._error(404, f"no route POST {self.path}")
                return
            if episode is None:
                self._error(404, "requests name their episode: POST /s/<episode_id>/v1/chat/completions")
                return
            try:
                self._send(200, app.chat(episode, parse_body(raw, limits)))
            except HTTPError as exc:
                self._error(exc.status, str(exc))
            except (ConnectionError, TimeoutError):  # the client is gone: no one to answer
                raise
            except Exception as exc:  # a bug: its traceback in the log, a 500 to the client
                log.exception("openai endpoint: %s failed", self.path[:200])
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
