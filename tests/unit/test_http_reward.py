"""HttpReward against real HTTP servers on 127.0.0.1: batching, concurrency, retries, timeouts, errors."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_rl.config import HttpRewardConfig
from megatron_rl.demo.toy import build_toy_tokenizer
from megatron_rl.errors import LaunchError
from megatron_rl.reward.http import HttpReward, HttpRewardError, HttpRewardManager, prompt_ids_of
from megatron_rl.run.explain import explain

# A handler gets (request number from 1, parsed request body) and returns (status, body bytes).
Handler = Callable[[int, dict], tuple[int, bytes]]


class Server:
    """A ThreadingHTTPServer on an ephemeral port that records requests and the most in flight at once."""

    def __init__(self, handle: Handler) -> None:
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        lock = threading.Lock()
        server = self

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    server.requests.append(body)
                    number = len(server.requests)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    status, reply = handle(number, body)
                finally:
                    with lock:
                        server.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except OSError:  # the client gave up (timeout tests)
                    pass

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        # A short poll interval: shutdown() waits for it.
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], Server]]:
    servers: list[Server] = []

    def start(handle: Handler) -> Server:
        servers.append(Server(handle))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def good(number: int, body: dict) -> tuple[int, bytes]:
    """Score = len(response); extras echo the sample index; later batches answer sooner (so replies
    arrive out of order)."""
    samples = body["samples"]
    time.sleep(max(0.0, 0.2 - 0.05 * samples[0]["extra_info"]["index"] / 4))
    return 200, _json(
        {
            "scores": [len(s["response"]) for s in samples],
            "extras": [{"index": s["extra_info"]["index"], "note": "not a number"} for s in samples],
        }
    )


def _cfg(url: str, **kw) -> HttpRewardConfig:
    base = dict(url=url, batch_size=4, concurrency=2, timeout_s=2.0, retries=2, backoff_s=0.01)
    base.update(kw)
    return HttpRewardConfig(**base)


def _columns(n: int) -> tuple[list, list, list, list, list]:
    return (
        [f"src{i % 2}" for i in range(n)],
        [f"prompt {i}" for i in range(n)],
        ["x" * (i + 1) for i in range(n)],
        [str(i) for i in range(n)],
        [{"index": i} for i in range(n)],
    )


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text
    assert explain(err) == text  # the launcher prints it as is
    return text


# ---------------------------------------------------------------- success


def test_batches_order_extras_and_concurrency(serve):
    server = serve(good)
    scores, extras = HttpReward(_cfg(server.url, batch_size=4, concurrency=2))(*_columns(10))
    assert scores == [float(i + 1) for i in range(10)]
    assert extras == [{"index": float(i)} for i in range(10)]  # non-numeric extras are dropped
    assert sorted(len(r["samples"]) for r in server.requests) == [2, 4, 4]
    assert server.max_in_flight == 2
    sample = next(s for r in server.requests for s in r["samples"] if s["extra_info"]["index"] == 5)
    assert sample == {
        "data_source": "src1",
        "prompt": "prompt 5",
        "response": "xxxxxx",
        "ground_truth": "5",
        "extra_info": {"index": 5},
    }


def test_concurrency_one_is_sequential(serve):
    server = serve(good)
    scores, _ = HttpReward(_cfg(server.url, batch_size=3, concurrency=1))(*_columns(7))
    assert scores == [float(i + 1) for i in range(7)]
    assert len(server.requests) == 3 and server.max_in_flight == 1


def test_empty_batch_sends_nothing(serve):
    server = serve(good)
    assert HttpReward(_cfg(server.url))([], [], [], [], []) == ([], [])
    assert server.requests == []


def test_numpy_values_are_sent_as_json(serve):
    np = pytest.importorskip("numpy")
    server = serve(lambda n, body: (200, _json({"scores": [1.0] * len(body["samples"])})))
    HttpReward(_cfg(server.url))(["s"], ["p"], ["r"], [np.int64(7)], [{"v": np.arange(2)}])
    assert server.requests[0]["samples"][0]["ground_truth"] == 7
    assert server.requests[0]["samples"][0]["extra_info"] == {"v": [0, 1]}


def test_manager_decodes_and_returns_reward_output(serve):
    server = serve(good)
    tok = build_toy_tokenizer()
    prompts = torch.tensor([[0, 0, 14, 7], [0, 14, 8, 9]])  # left padded with <pad>=0
    prompt_ids = prompt_ids_of(prompts, prompts != 0)
    assert prompt_ids == [[14, 7], [14, 8, 9]]
    manager = HttpRewardManager(tok, _cfg(server.url))
    assert manager.needs_prompts
    out = manager([[7, 2], [9]], ["toy", "toy"], ["3", "5"], [{"index": 0}, {"index": 1}], prompt_ids)
    sent = server.requests[0]["samples"]
    assert [s["prompt"] for s in sent] == ["copy 3", "copy 4 5"]
    assert [s["response"] for s in sent] == ["3", "5"]  # EOS skipped
    assert out.scores.dtype == torch.float32 and out.scores.tolist() == [1.0, 1.0]
    assert out.extras["index"].tolist() == [0.0, 1.0] and out.num_errors == 0


# ---------------------------------------------------------------- retries


def test_server_error_after_retries_is_one_line(serve):
    server = serve(lambda n, body: (500, b"Traceback (most recent call last):\n  boom" + b"x" * 500))
    with pytest.raises(HttpRewardError) as info:
        HttpReward(_cfg(server.url, retries=2))(*_columns(3))
    text = _one_line(info.value)
    assert len(server.requests) == 3  # 1 + 2 retries
    assert server.url in text and "HTTP 500" in text and "3 attempts" in text and "boom" in text
    assert "x" * 200 not in text  # the body is cut at 200 characters


def test_transient_failures_then_success(serve):
    def flaky(number: int, body: dict) -> tuple[int, bytes]:
        if number <= 2:
            return (503 if number == 1 else 429), b"busy"
        return 200, _json({"scores": [0.5] * len(body["samples"])})

    server = serve(flaky)
    scores, extras = HttpReward(_cfg(server.url, retries=3, backoff_s=0.05))(*_columns(2))
    assert scores == [0.5, 0.5] and extras == [{}, {}]
    assert len(server.requests) == 3


def test_not_found_is_not_retried(serve):
    server = serve(lambda n, body: (404, b"no such route"))
    with pytest.raises(HttpRewardError) as info:
        HttpReward(_cfg(server.url, retries=3))(*_columns(2))
    text = _one_line(info.value)
    assert len(server.requests) == 1
    assert "HTTP 404" in text and "no such route" in text and "1 attempt" in text and server.url in text


def test_timeout_names_the_key_and_is_bounded(serve):
    def slow(number: int, body: dict) -> tuple[int, bytes]:
        time.sleep(1.5)
        return 200, _json({"scores": [0.0] * len(body["samples"])})

    server = serve(slow)
    cfg = _cfg(server.url, timeout_s=0.3, retries=1, backoff_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(HttpRewardError) as info:
        HttpReward(cfg)(*_columns(2))
    elapsed = time.monotonic() - t0
    text = _one_line(info.value)
    assert "reward_model.http.timeout_s=0.3" in text and server.url in text and "2 attempts" in text
    bound = (cfg.retries + 1) * cfg.timeout_s + cfg.backoff_s * (2**cfg.retries - 1)  # 0.7 s
    assert 0.6 <= elapsed <= bound + 0.5
    assert len(server.requests) == 2


def test_failure_stops_other_batches(serve):
    """One batch's 404 ends the call at once; batches still queued are not sent."""

    def handle(number: int, body: dict) -> tuple[int, bytes]:
        if body["samples"][0]["extra_info"]["index"] == 0:
            return 404, b"gone"
        time.sleep(0.2)
        return 200, _json({"scores": [0.0] * len(body["samples"])})

    server = serve(handle)
    with pytest.raises(HttpRewardError, match="HTTP 404"):
        HttpReward(_cfg(server.url, batch_size=1, concurrency=2))(*_columns(20))
    time.sleep(0.3)
    assert len(server.requests) < 5


# ---------------------------------------------------------------- malformed replies


@pytest.mark.parametrize(
    "reply, expected",
    [
        (b"<html>oops</html>", "not JSON"),
        (_json({"score": [1, 2, 3]}), 'no "scores" key'),
        (_json({"scores": [1.0, 2.0]}), "list of 3 numbers, got 2 scores"),
        (b'{"scores": [1.0, NaN, 2.0]}', "score of sample 1 is nan, not finite"),
        (_json({"scores": [1.0, 2.0, "3"]}), "score of sample 2 is '3', not a number"),
        (_json({"scores": [1, 2, 3], "extras": [{}]}), '"extras" must be a list of 3 objects'),
    ],
)
def test_malformed_reply(serve, reply, expected):
    server = serve(lambda n, body: (200, reply))
    with pytest.raises(HttpRewardError) as info:
        HttpReward(_cfg(server.url, retries=3))(*_columns(3))
    text = _one_line(info.value)
    assert expected in text and server.url in text and "malformed reply to samples 0..2" in text
    assert len(server.requests) == 1  # not retried


def test_malformed_reply_names_the_global_sample_index(serve):
    def handle(number: int, body: dict) -> tuple[int, bytes]:
        scores = [1.0] * len(body["samples"])
        if body["samples"][0]["extra_info"]["index"] == 4:
            scores[1] = None
        return 200, _json({"scores": scores})

    server = serve(handle)
    with pytest.raises(HttpRewardError, match=r"samples 4\.\.7: score of sample 5 is None"):
        HttpReward(_cfg(server.url, batch_size=4))(*_columns(10))


# ---------------------------------------------------------------- unreachable and bad config


def test_connection_refused_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"  # nothing listens there any more
    with pytest.raises(HttpRewardError) as info:
        HttpReward(_cfg(url, retries=1))(*_columns(1))
    text = _one_line(info.value)
    assert url in text and "connection refused" in text and "2 attempts" in text


def test_bad_url_is_rejected_at_construction():
    with pytest.raises(HttpRewardError, match="reward_model.http.url='localhost:8000'") as info:
        HttpReward(_cfg("localhost:8000"))
    assert isinstance(info.value, LaunchError) and info.value.same_on_all_ranks
    with pytest.raises(HttpRewardError):
        HttpReward(_cfg(None))


def test_unserializable_sample_names_the_index(serve):
    server = serve(good)
    with pytest.raises(HttpRewardError, match="sample 1: its extra_info is not JSON-serializable"):
        HttpReward(_cfg(server.url))(["a", "b"], ["p", "p"], ["r", "r"], ["1", "2"], [{}, {"x": object()}])
    assert server.requests == []


def test_scores_are_finite_floats(serve):
    server = serve(lambda n, body: (200, _json({"scores": [True, 2, -1.5][: len(body["samples"])]})))
    scores, _ = HttpReward(_cfg(server.url))(*_columns(3))
    assert scores == [1.0, 2.0, -1.5] and all(math.isfinite(s) for s in scores)


# ---------------------------------------------------------------- bounds and network


class _RawServer:
    """A server whose handler writes the raw reply itself (``write(handler)``), recording each request."""

    def __init__(self, write: Callable[[BaseHTTPRequestHandler], None]) -> None:
        self.paths: list[str] = []
        server = self

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["Content-Length"]))
                server.paths.append(self.path)
                try:
                    write(self)
                except OSError:  # the client stopped reading
                    pass

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def raw() -> Iterator[Callable]:
    servers: list[_RawServer] = []

    def start(write) -> _RawServer:
        servers.append(_RawServer(write))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_a_reply_over_the_size_limit_is_refused(serve):
    big = _json({"scores": [1.0, 2.0], "pad": "x" * 5000})
    server = serve(lambda n, body: (200, big))
    with pytest.raises(HttpRewardError) as info:
        HttpReward(_cfg(server.url, max_response_bytes=4096, retries=3))(*_columns(2))
    text = _one_line(info.value)
    assert "reward_model.http.max_response_bytes=4096" in text and len(server.requests) == 1  # not retried
    # the same reply under a limit it fits
    scores, _ = HttpReward(_cfg(server.url, max_response_bytes=len(big)))(*_columns(2))
    assert scores == [1.0, 2.0]


def test_an_endless_reply_without_a_length_is_cut_at_the_limit(raw):
    def endless(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()  # no Content-Length: the body lasts until the connection closes
        h.wfile.write(b'{"scores": [1, 2], "pad": "')
        while True:
            h.wfile.write(b"x" * 65536)

    server = raw(endless)
    with pytest.raises(HttpRewardError, match=r"larger than reward_model\.http\.max_response_bytes=1048576"):
        HttpReward(_cfg(server.url, max_response_bytes=2**20, timeout_s=20.0))(*_columns(2))


def test_the_environment_proxy_is_ignored_unless_configured(serve, monkeypatch):
    direct = serve(lambda n, body: (200, _json({"scores": [1.0] * len(body["samples"])})))
    proxy = serve(lambda n, body: (200, _json({"scores": [7.0] * len(body["samples"])})))
    proxy_url = proxy.url.rsplit("/", 1)[0]
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("http_proxy", proxy_url)
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    scores, _ = HttpReward(_cfg(direct.url))(*_columns(2))
    assert scores == [1.0, 1.0] and proxy.requests == [] and len(direct.requests) == 1
    # configured: the request goes through the proxy (which answers it here)
    scores, _ = HttpReward(_cfg(direct.url, proxy=proxy_url))(*_columns(2))
    assert scores == [7.0, 7.0] and len(proxy.requests) == 1 and len(direct.requests) == 1


def test_timed_out_attempts_are_counted_and_bounded(raw):
    release = threading.Event()

    def trickle(h: BaseHTTPRequestHandler) -> None:
        # headers a line at a time, each within the socket timeout: the client's read never times out,
        # only the attempt's own deadline ends the wait
        h.wfile.write(b"HTTP/1.1 200 OK\r\n")
        while not release.wait(0.05):
            h.wfile.write(b"X-Pad: a\r\n")
            h.wfile.flush()

    server = raw(trickle)
    http = HttpReward(_cfg(server.url, timeout_s=0.3, retries=3, backoff_s=0.01, max_abandoned_threads=2))
    try:
        with pytest.raises(HttpRewardError) as info:
            http(*_columns(2))
        text = _one_line(info.value)
        assert "2 requests that timed out are still running" in text
        assert "reward_model.http.max_abandoned_threads=2" in text
        assert len(server.paths) == 2 and http.abandoned_threads() == 2
    finally:
        release.set()
    for _ in range(200):  # the server stops: the abandoned threads end
        if http.abandoned_threads() == 0:
            break
        time.sleep(0.05)
    assert http.abandoned_threads() == 0


def test_the_manager_reports_abandoned_threads(serve):
    server = serve(good)
    manager = HttpRewardManager(build_toy_tokenizer(), _cfg(server.url))
    out = manager([[7, 2]], ["toy"], ["3"], [{"index": 0}], [[14, 7]])
    assert out.extras["http_abandoned"].tolist() == [0.0]
