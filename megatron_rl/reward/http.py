"""Rewards served over HTTP: decoded samples -> JSON batches -> a reward server -> per-sequence scores.

Data flow (one PPO step, on the first rank of each model replica, like the rule rewards):

    HttpRewardManager(tokenizer, cfg.reward_model.http)(response_ids, data_sources, ground_truths,
                                                        extra_infos, prompt_ids=...)
        decodes prompts and responses (special tokens skipped, as RewardManager decodes responses),
        calls HttpReward(data_sources, prompts, responses, ground_truths, extra_infos)
            which splits the samples into batches of ``batch_size``, POSTs each batch to ``url`` with
            up to ``concurrency`` requests in flight, and returns (scores, extras) in sample order,
        and returns a RewardOutput (scores [B], extras [B] per key, num_errors=0) for scoring.reward_scores.

Protocol (also in docs/rewards.md). Each request is

    POST <url>   Content-Type: application/json
    {"samples": [{"data_source": str, "prompt": str, "response": str,
                  "ground_truth": <the dataset's value>, "extra_info": <dict or null>}, ...]}

with 1..batch_size samples. A 2xx reply's body must be JSON

    {"scores": [number, ...], "extras": [{"<key>": number, ...}, ...]}

"scores": one finite number per sample, in request order. "extras" (optional): one object per sample;
its numeric keys are logged like the extra keys of a dict-returning reward function
(reward/<key>/mean, val-aux/..., algorithm.filter_groups.metric); other values are ignored.

Failures. A connection error (refused, reset, DNS), a timeout, HTTP 429 and HTTP 5xx are retried
``retries`` times, after ``backoff_s``, 2 x backoff_s, 4 x backoff_s, ... seconds. Any other non-2xx
status (a redirect included) and a malformed reply are not retried: the same request would get the
same answer. What is left after the retries stops the run with ONE line (:class:`HttpRewardError`, a
LaunchError) naming the URL, what went wrong and the key to change. There is no partial result: a
score of 0 for a sample the server did not score would train on a wrong reward.

Time. Each attempt runs on its own daemon thread and is abandoned after ``timeout_s`` (connection,
DNS lookup, upload and reply together), so one request takes at most
``(retries + 1) * timeout_s + backoff_s * (2**retries - 1)`` seconds and one call at most
ceil(batches / concurrency) times that. After the first definitive failure no new attempt starts.
An abandoned thread stops reading at its own deadline (it ends within about one more ``timeout_s``);
those still alive are counted (logged as reward/http_abandoned/mean) and bounded: with
``max_abandoned_threads`` of them alive, the next attempt stops the run instead of starting another.

Bounds and network. A reply is read in chunks up to ``max_response_bytes`` (a longer one, or a
Content-Length above it, fails the batch without reading the rest); the body of an error status is
read up to a few hundred bytes. Requests go straight to the server: the environment's http_proxy /
https_proxy are ignored unless ``proxy`` names one (the samples and ground truths pass through it).
Redirects are not followed.
"""

from __future__ import annotations

import json
import math
import numbers
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_rl.errors import LaunchError
from megatron_rl.reward.source import RewardSource, response_token_lists

if TYPE_CHECKING:
    import torch

    from megatron_rl.config import HttpRewardConfig
    from megatron_rl.reward.source import RewardOutput

SAMPLE_KEYS = ("data_source", "prompt", "response", "ground_truth", "extra_info")
"""The keys of each sample in a request."""

_BODY_SNIPPET_CHARS = 200
_CHUNK_BYTES = 1 << 16
_PROTOCOL = 'the reply must be {"scores": [one finite number per sample]} (see docs/rewards.md)'


class HttpRewardError(LaunchError):
    """The reward server could not score a batch (after the retries); the message is one line."""


@dataclass
class _Failure:
    """Why one attempt failed; ``retry`` says whether another attempt may help."""

    kind: str  # "connect" | "timeout" | "http"
    detail: str
    retry: bool


def prompt_ids_of(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The real tokens of left-padded prompts [B, P] (``prompt_mask`` [B, P]: 1 on real tokens), one list
    per row: ``prompt_ids_of(batch.prompts, batch.attention_mask[:, :batch.prompts.shape[1]])``."""
    prompts, mask = prompts.cpu(), prompt_mask.cpu().bool()
    return [row[m].tolist() for row, m in zip(prompts, mask, strict=True)]


class HttpReward:
    """Scores samples with a reward server (the protocol is in this module's docstring).

    ``cfg`` is ``reward_model.http``. Thread-safe: every call has its own pool of ``concurrency``
    threads, shut down before the call returns (an abandoned attempt's thread is a daemon and ends on
    its own socket timeout).
    """

    def __init__(self, cfg: HttpRewardConfig) -> None:
        url = cfg.url or ""
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise HttpRewardError(
                f"reward_model.http.url={url!r} is not an http:// or https:// URL; set it to the reward "
                "server's endpoint, e.g. http://host:8000/score.",
                same_on_all_ranks=True,
            )
        self.cfg = cfg
        self.url = url
        # A redirected POST turns into a GET in urllib (301/302/303): refuse redirects instead, so the
        # server's answer is reported as an HTTP error that names the status. ProxyHandler({}) keeps
        # urllib from picking a proxy out of the environment.
        proxies = {"http": cfg.proxy, "https": cfg.proxy} if cfg.proxy else {}
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies), _NoRedirect)
        self._abandoned: list[threading.Thread] = []  # attempts that timed out, maybe still running
        self._lock = threading.Lock()

    def abandoned_threads(self) -> int:
        """Threads of timed-out attempts still alive (each ends at its own read deadline)."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)

    # ------------------------------------------------------------------------------------------ calls

    def __call__(
        self,
        data_sources: Sequence[str],
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> tuple[list[float], list[dict[str, float]]]:
        """Scores [B] and per-sample extra keys [B], in input order (column form of :meth:`score`)."""
        n = len(responses)
        if extra_infos is None:
            extra_infos = [None] * n
        if not (len(data_sources) == len(prompts) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"HttpReward got {n} responses, {len(prompts)} prompts, {len(data_sources)} data_sources, "
                f"{len(ground_truths)} ground_truths and {len(extra_infos)} extra_infos"
            )
        samples = [
            dict(zip(SAMPLE_KEYS, row, strict=True))
            for row in zip(data_sources, prompts, responses, ground_truths, extra_infos, strict=True)
        ]
        return self.score(samples)

    def score(self, samples: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[dict[str, float]]]:
        """Scores and extras of ``samples`` (dicts with the keys :data:`SAMPLE_KEYS`), in order."""
        size = self.cfg.batch_size
        batches = [
            (start, [{k: s.get(k) for k in SAMPLE_KEYS} for s in samples[start : start + size]])
            for start in range(0, len(samples), size)
        ]
        if not batches:
            return [], []
        stop = threading.Event()
        pool = ThreadPoolExecutor(
            max_workers=min(self.cfg.concurrency, len(batches)), thread_name_prefix="http-reward"
        )
        try:
            futures = [pool.submit(self._score_batch, start, batch, stop) for start, batch in batches]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future in done and future.exception() is not None:
                    # The first batch (in sample order) that failed; the others stop retrying.
                    stop.set()
                    raise future.exception()
            scores: list[float] = []
            extras: list[dict[str, float]] = []
            for future in futures:
                batch_scores, batch_extras = future.result()
                scores += batch_scores
                extras += batch_extras
            return scores, extras
        finally:
            stop.set()
            # Queued batches are dropped; a running one returns within one attempt (timeout_s).
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------- one batch

    def _score_batch(
        self, start: int, batch: list[dict[str, Any]], stop: threading.Event
    ) -> tuple[list[float], list[dict[str, float]]]:
        body = self._encode(start, batch)
        where = f"samples {start}..{start + len(batch) - 1}"
        attempts = self.cfg.retries + 1
        for attempt in range(1, attempts + 1):
            # Exponential backoff before a retry, cut short when another batch has failed for good (its
            # error is the one raised; this one is never read).
            if (attempt > 1 and stop.wait(self.cfg.backoff_s * 2 ** (attempt - 2))) or stop.is_set():
                raise HttpRewardError(f"reward_model.http.url={self.url}: cancelled")
            reply = self._attempt(body)
            if isinstance(reply, bytes):
                return self._parse(reply, start, len(batch))
            if not reply.retry or attempt == attempts:
                raise HttpRewardError(self._message(reply, where, attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _message(self, failure: _Failure, where: str, attempts: int) -> str:
        tried = f"{attempts} attempt{'s' if attempts > 1 else ''}"
        head = f"reward_model.http.url={self.url}"
        if failure.kind == "connect":
            return (
                f"{head}: cannot reach the reward server ({failure.detail}) after {tried}; start the "
                "server, or fix the host and port in reward_model.http.url."
            )
        if failure.kind == "timeout":
            return (
                f"{head}: no reply within reward_model.http.timeout_s={self.cfg.timeout_s:g} s for {where} "
                f"({tried}); make the server faster, lower reward_model.http.batch_size or "
                "reward_model.http.concurrency, or raise reward_model.http.timeout_s."
            )
        return f"{head}: {failure.detail} for {where} after {tried}"

    def _encode(self, start: int, batch: list[dict[str, Any]]) -> bytes:
        try:
            return json.dumps({"samples": batch}, default=_to_json).encode()
        except (TypeError, ValueError):
            pass
        for j, sample in enumerate(batch):  # find the culprit for the message
            for key, value in sample.items():
                try:
                    json.dumps(value, default=_to_json)
                except (TypeError, ValueError) as exc:
                    raise HttpRewardError(
                        f"reward_model.http.url={self.url}: sample {start + j}: its {key} is not "
                        f"JSON-serializable ({exc}); store plain strings, numbers, lists and dicts in the "
                        "dataset's reward_model/extra_info columns."
                    ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _attempt(self, body: bytes) -> bytes | _Failure:
        """One POST, abandoned after timeout_s: the reply body of a 2xx status, or why it failed."""
        box: list[bytes | _Failure] = []
        alive, bound = self.abandoned_threads(), self.cfg.max_abandoned_threads
        if alive >= bound:
            raise HttpRewardError(
                f"reward_model.http.url={self.url}: {alive} requests that timed out are still running "
                f"(reward_model.http.max_abandoned_threads={bound}): the server accepts connections but "
                "does not answer; fix the server, or raise reward_model.http.timeout_s."
            )
        deadline = time.monotonic() + self.cfg.timeout_s

        def run() -> None:
            box.append(self._post(body, deadline))

        # urllib's timeout bounds each socket operation, not the request (nor the DNS lookup), so a
        # server that trickles its reply could hold a call far longer; a daemon thread that is left
        # behind on timeout bounds the attempt itself (and stops reading at the deadline).
        thread = threading.Thread(target=run, name="http-reward-request", daemon=True)
        thread.start()
        thread.join(self.cfg.timeout_s)
        if not box:
            with self._lock:
                self._abandoned.append(thread)
            return _Failure("timeout", "", retry=True)
        return box[0]

    def _post(self, body: bytes, deadline: float = math.inf) -> bytes | _Failure:
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with self._opener.open(request, timeout=self.cfg.timeout_s) as reply:
                return self._read_bounded(reply, deadline)
        except urllib.error.HTTPError as exc:
            return self._http_failure(exc)
        except urllib.error.URLError as exc:
            return _connection_failure(exc.reason)
        except Exception as exc:  # reset, IncompleteRead, ...: the connection broke
            return _connection_failure(exc)

    def _read_bounded(self, reply, deadline: float) -> bytes | _Failure:
        """The reply body, at most max_response_bytes, read in chunks until ``deadline``."""
        limit = self.cfg.max_response_bytes
        too_big = _Failure(
            "http",
            f"the reply is larger than reward_model.http.max_response_bytes={limit} bytes; return one "
            "score per sample (and small extras), or raise reward_model.http.max_response_bytes",
            retry=False,
        )
        length = reply.headers.get("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            return too_big
        chunks, size = [], 0
        while True:
            if time.monotonic() > deadline:
                return _Failure("timeout", "", retry=True)
            # read1: what has arrived (up to the size), so a trickling reply still meets the deadline
            chunk = reply.read1(min(_CHUNK_BYTES, limit + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return too_big

    def _http_failure(self, exc: urllib.error.HTTPError) -> _Failure:
        try:
            text = exc.read(4 * _BODY_SNIPPET_CHARS).decode("utf-8", "replace")
        except Exception:  # the body is only for the message
            text = ""
        finally:
            exc.close()
        snippet = text[:_BODY_SNIPPET_CHARS]
        code = exc.code
        status = f"HTTP {code} {exc.reason}".rstrip()
        if code == 429:
            fix = "the server is overloaded: lower reward_model.http.concurrency or raise retries/backoff_s"
        elif code >= 500:
            fix = "the server failed; see its log"
        elif code == 404:
            fix = "check the path in reward_model.http.url"
        elif 300 <= code < 400:
            fix = f"set reward_model.http.url to the redirect target ({exc.headers.get('Location')})"
        else:
            fix = "the server rejected the request; see its log and the protocol in docs/rewards.md"
        return _Failure("http", f"{status}, body {snippet!r}; {fix}", retry=code == 429 or code >= 500)

    def _parse(self, body: bytes, start: int, n: int) -> tuple[list[float], list[dict[str, float]]]:
        """Scores and extras of one batch's reply; HttpRewardError (not retried) if it is malformed."""

        def bad(what: str) -> HttpRewardError:
            return HttpRewardError(
                f"reward_model.http.url={self.url}: malformed reply to samples {start}..{start + n - 1}: "
                f"{what}; {_PROTOCOL}."
            )

        try:
            reply = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            snippet = body[:_BODY_SNIPPET_CHARS].decode("utf-8", "replace")
            raise bad(f"not JSON (body {snippet!r})") from None
        if not isinstance(reply, dict) or "scores" not in reply:
            keys = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise bad(f'no "scores" key (got {keys})')
        scores = reply["scores"]
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else type(scores).__name__
            raise bad(f'"scores" must be a list of {n} numbers, got {got}')
        values: list[float] = []
        for j, s in enumerate(scores):
            if not isinstance(s, numbers.Real):
                raise bad(f"score of sample {start + j} is {s!r}, not a number")
            if not math.isfinite(float(s)):
                raise bad(f"score of sample {start + j} is {s!r}, not finite")
            values.append(float(s))
        extras = reply.get("extras")
        if extras is None:
            return values, [{} for _ in range(n)]
        if not isinstance(extras, list) or len(extras) != n:
            got = f"{len(extras)} entries" if isinstance(extras, list) else type(extras).__name__
            raise bad(f'"extras" must be a list of {n} objects, got {got}')
        out: list[dict[str, float]] = []
        for j, e in enumerate(extras):
            if e is None:
                e = {}
            if not isinstance(e, dict):
                raise bad(f"extras of sample {start + j} is {type(e).__name__}, not an object")
            # As for a reward function's dict: "score" is the score, non-numeric values are not logged.
            out.append(
                {
                    str(k): float(v)
                    for k, v in e.items()
                    if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))
                }
            )
        return values, out


class HttpRewardManager(RewardSource):
    """RewardManager's interface over :class:`HttpReward`: token ids in, a RewardOutput out (a reward
    source of reward.source's protocol, on one rank per replica, reading the prompts too).

    ``__call__`` takes RewardManager's arguments plus ``prompt_ids`` (each prompt's real tokens, see
    :func:`prompt_ids_of`); both are decoded with ``skip_special_tokens=True``. A failure raises
    :class:`HttpRewardError` (there is no per-sample error), so ``num_errors`` is always 0.
    """

    needs_prompts = True
    """The server receives the prompt text too (:meth:`score_batch` passes ``prompt_ids``)."""

    def __init__(self, tokenizer: Any, cfg: HttpRewardConfig) -> None:
        self.tokenizer = tokenizer
        self.http = HttpReward(cfg)

    @property
    def name(self) -> str:
        return f"reward server {self.http.url}"

    def score_batch(self, batch, response_lengths: torch.Tensor) -> RewardOutput:
        prompt_ids = prompt_ids_of(batch.prompts, batch.attention_mask[:, : batch.prompts.shape[1]])
        return self(
            response_token_lists(batch, response_lengths),
            [mt.data_source for mt in batch.meta],
            [mt.ground_truth for mt in batch.meta],
            [mt.extra_info for mt in batch.meta],
            prompt_ids=prompt_ids,
        )

    def __call__(
        self,
        response_ids: Sequence[Sequence[int]],
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
    ) -> RewardOutput:
        import torch

        from megatron_rl.reward.source import RewardOutput

        n = len(response_ids)
        if prompt_ids is None:
            raise ValueError("HttpRewardManager needs prompt_ids (the server receives the prompt text)")
        if len(prompt_ids) != n:
            raise ValueError(f"HttpRewardManager got {n} responses and {len(prompt_ids)} prompts")
        decode = self.tokenizer.batch_decode
        responses = decode([list(r) for r in response_ids], skip_special_tokens=True)
        prompts = decode([list(p) for p in prompt_ids], skip_special_tokens=True)
        scores, extras = self.http(data_sources, prompts, responses, ground_truths, extra_infos)
        out = RewardOutput.from_rows(torch.tensor(scores, dtype=torch.float32).reshape(n), extras, 0)
        # logged as reward/http_abandoned/mean: timed-out attempts whose threads are still alive
        out.extras["http_abandoned"] = torch.full((n,), float(self.http.abandoned_threads()))
        return out


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises HTTPError with the 3xx status


def _to_json(value: Any) -> Any:
    """numpy scalars and arrays (from parquet columns) as plain Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _connection_failure(reason: object) -> _Failure:
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return _Failure("timeout", "", retry=True)
    if isinstance(reason, socket.gaierror):
        return _Failure("connect", f"host name lookup failed: {reason}", retry=True)
    if isinstance(reason, ConnectionRefusedError):
        return _Failure("connect", "connection refused", retry=True)
    text = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
    return _Failure("connect", " ".join(text.split()), retry=True)
