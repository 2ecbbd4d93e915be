"""Rule rewards: response token ids -> decoded text -> per-sequence scores.

Data flow (one PPO step):

    RewardManager(tokenizer, compute_score, kwargs)(responses, data_sources, ground_truths, extra_infos)
        decodes each response (special tokens skipped), calls
        compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)
        and returns a RewardOutput: float32 scores [B], the per-sample extra keys, the error count. The
        trainer places each score on the sequence's last response token.

``compute_score`` has verl's custom-reward signature, so verl reward files load unchanged through
``load_custom_reward_function(custom_reward_function.path, custom_reward_function.name)``. It may return a
number or a dict with a "score" key; its other numeric keys are logged (reward/<key>/mean, and per data
source in validation) and may drive DAPO's group filter (algorithm.filter_groups.metric).

Built in (``default_compute_score`` dispatches on ``data_source``):
    "openai/gsm8k", "gsm8k"   -> compute_score_gsm8k (verl's strict "#### <number>" rule; reward_kwargs
                                 method=flexible, lenient=True, format_score, score)
    demo.toy.TOY_DATA_SOURCE  -> demo.toy.toy_compute_score (the CPU demo's task)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import numbers
import queue
import re
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.demo.toy import TOY_DATA_SOURCE, toy_compute_score
from megatron_rl.errors import LaunchError, NonFiniteRewardError
from megatron_rl.reward.source import RewardOutput, RewardSource, response_token_lists

logger = logging.getLogger(__name__)

GSM8K_DATA_SOURCES = ("openai/gsm8k", "gsm8k")
RULE_DATA_SOURCES = (*GSM8K_DATA_SOURCES, TOY_DATA_SOURCE)
"""The data_source values ``default_compute_score`` scores."""

# Only the tail of a response is searched, so an answer-shaped number that the model wrote early in a
# long (possibly degenerate) response does not count.
_SOLUTION_CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")
_LENIENT_STRICT_RE = re.compile(r"#### \$?(-?[0-9.,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K response as written, or None (verl's rule, character for character).

    Only the last 300 characters are searched.
    strict: the last "#### " followed directly by an optional "-" and a run of digits, "." and ","
        (so "#### $12" has no answer); "," is removed from it ("#### 1,234" -> "1234", "#### 72." -> "72.").
    flexible: the last run of digits, "." and "," (an optional "-" before it) that is not a lone ".";
        nothing is removed ("1,234" stays "1,234").
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT_RE.findall(tail)
        return matches[-1].replace(",", "").replace("$", "") if matches else None
    matches = _NUMBER_RE.findall(tail)
    answer = None
    for answer in reversed(matches):
        if answer not in ("", "."):
            break
    return answer


def _lenient_answer(solution_str: str, method: str) -> str | None:
    """The lenient reading: "$" allowed after "####", thousands separators and a trailing "." dropped,
    digit-less matches skipped."""
    tail = solution_str[-_SOLUTION_CLIP_CHARS:]
    for match in reversed((_LENIENT_STRICT_RE if method == "strict" else _NUMBER_RE).findall(tail)):
        answer = _normalize_number(match)
        if any(ch.isdigit() for ch in answer):
            return answer
    return None


def _normalize_number(text: str) -> str:
    return text.strip().replace(",", "").replace("$", "").rstrip(".")


def compute_score_gsm8k(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    lenient: bool = False,
) -> float:
    """``score`` when the extracted answer equals ``ground_truth`` exactly (string equality, as verl),
    ``format_score`` for a wrong but extractable one, else 0.

    ``lenient=True`` (``custom_reward_function.reward_kwargs.lenient``) also accepts "#### $12",
    "#### 72." and "1,234" against "1234", and normalises the ground truth the same way (an int, " 72 ");
    its scores are not comparable with verl's.
    """
    if lenient:
        answer = _lenient_answer(solution_str, method)
        if answer is None:
            return 0.0
        return score if answer == _normalize_number(str(ground_truth)) else format_score
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """Dispatch to the built-in rule for ``data_source``; ``kwargs`` go to that rule."""
    if data_source in GSM8K_DATA_SOURCES:
        return compute_score_gsm8k(solution_str, ground_truth, **kwargs)
    if data_source == TOY_DATA_SOURCE:
        return toy_compute_score(solution_str, ground_truth, extra_info, **kwargs)
    raise NotImplementedError(
        f"no built-in reward for data_source={data_source!r} (built in: "
        f"{list(RULE_DATA_SOURCES)}). Write a function "
        "compute_score(data_source, solution_str, ground_truth, extra_info=None) and point "
        "custom_reward_function.path at its .py file and custom_reward_function.name at its name."
    )


def load_custom_reward_function(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """Import function ``name`` from the Python file at ``path``."""
    if not path:
        raise ValueError("custom_reward_function.path is empty; set it to a .py file")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path={path!r}: no such file")
    # A name unique per file, so two reward files with the same basename do not replace each other in
    # sys.modules (registration there lets pickling and dataclasses inside the file work).
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:10]
    module_name = f"megatron_rl_custom_reward_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path={path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ImportError(f"importing custom_reward_function.path={path!r} failed: {exc!r}") from exc
    if not hasattr(module, name):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom_reward_function.name={name!r} not found in {path!r}; functions there: {available}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(
            f"custom_reward_function.name={name!r} in {path!r} is {type(fn).__name__}, not callable"
        )
    return fn


def _truncate(text: str, limit: int = 300) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ...[{len(text) - limit} chars]... {text[-half:]}"


class RewardManager(RewardSource):
    """Scores decoded responses with ``compute_score``, one float per sequence (the built-in rules, or
    custom_reward_function: a reward source of reward.source's protocol, on one rank per replica).

    A sample whose reward function raises (or returns a non-numeric value) is logged with its index,
    data_source and response, scores 0.0, and is counted in ``RewardOutput.num_errors`` (metric
    ``reward/num_errors``). A NaN or infinite score stops the run (:class:`NonFiniteRewardError`, one
    line naming the function, the sample and its uid): it is a bug in the function, and one such score
    would void the step's update.
    If more than ``max_error_fraction`` of a batch's samples fail (custom_reward_function.
    max_error_fraction), the reward function is broken rather than unlucky, and training on their zeros
    would bias the run: a :class:`RewardFunctionError` names the key, the count and the first exception.

    Each call runs on a worker thread and may take at most ``timeout_s`` seconds
    (``custom_reward_function.timeout_s``; 0 = no limit): a call that takes longer, or one that exits the
    interpreter (``sys.exit``), stops the run with a :class:`RewardFunctionError` naming the function,
    the sample and its data_source. The worker is a daemon thread, so a hung call does not keep the
    process alive.
    """

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        reward_kwargs: dict[str, Any] | None = None,
        timeout_s: float = 0.0,
        max_error_fraction: float = 1.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score
        self.reward_kwargs = dict(reward_kwargs or {})
        self.timeout_s = timeout_s
        self.max_error_fraction = max_error_fraction
        self._worker: _Worker | None = None

    @property
    def name(self) -> str:
        fn = self.compute_score
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def score_batch(self, batch, response_lengths: torch.Tensor) -> RewardOutput:
        return self(
            response_token_lists(batch, response_lengths),
            [mt.data_source for mt in batch.meta],
            [mt.ground_truth for mt in batch.meta],
            [mt.extra_info for mt in batch.meta],
            uids=[mt.uid for mt in batch.meta],
        )

    def _call(
        self, i: int, data_source: str, text: str, ground_truth: Any, extra_info: Any, uid: str | None = None
    ) -> tuple[float, dict]:
        """``_score_one`` under the timeout; exceptions come back as they were raised."""
        if self._worker is None or not self._worker.is_alive():
            self._worker = _Worker()
        status, value = self._worker.run(
            lambda: self._score_one(data_source, text, ground_truth, extra_info), self.timeout_s or None
        )
        where = f"sample {i} (data_source={data_source!r}{'' if uid is None else f', uid {uid!r}'})"
        if status == "timeout":
            self._worker = None  # abandoned: still inside the hung call
            raise RewardFunctionError(
                f"reward function {self.name} did not return within {self.timeout_s:g} s on {where}; "
                "make it faster or raise custom_reward_function.timeout_s (0 = no limit)."
            )
        if status == "exit":
            raise RewardFunctionError(
                f"reward function {self.name} exited the process (SystemExit({value.code!r})) on {where}; "
                "a reward function must return a score or raise an exception."
            )
        if status == "error":
            raise value
        if not math.isfinite(value[0]):
            key = (
                "custom_reward_function.path/.name" if self.compute_score is not default_compute_score else ""
            )
            raise NonFiniteRewardError(
                f"reward function returned {value[0]} ({self.name}) on {where}; a reward must be a finite "
                f"number: fix the function{f' that {key} names' if key else ''}"
            )
        return value

    def _score_one(
        self, data_source: str, text: str, ground_truth: Any, extra_info: Any
    ) -> tuple[float, dict]:
        result = self.compute_score(
            data_source=data_source,
            solution_str=text,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **self.reward_kwargs,
        )
        extras: dict[str, Any] = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise KeyError(f"reward function returned a dict without 'score': {sorted(result)}")
            extras = {
                k: float(v)
                for k, v in result.items()
                if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))
            }
            pred = result.get("pred")  # a string answer: verl's majority vote (maj@k) counts it
            if not isinstance(pred, numbers.Real) and isinstance(pred, Hashable) and pred is not None:
                extras["pred"] = pred
            result = result["score"]
        if isinstance(result, torch.Tensor):
            result = result.item()
        if not isinstance(result, numbers.Real):
            raise TypeError(f"reward function returned {type(result).__name__}, expected a number")
        return float(result), extras  # a non-finite one is refused by the caller, naming the sample

    def __call__(
        self,
        response_ids: Sequence[Sequence[int]],
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
        uids: Sequence[str] | None = None,
    ) -> RewardOutput:
        """Scores of the decoded responses; ``uids`` (the batch's, optional) name the rows in errors."""
        n = len(response_ids)
        if extra_infos is None:
            extra_infos = [None] * n
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"RewardManager got {n} responses, {len(data_sources)} data_sources, "
                f"{len(ground_truths)} ground_truths and {len(extra_infos)} extra_infos"
            )
        texts = self.tokenizer.batch_decode([list(r) for r in response_ids], skip_special_tokens=True)

        scores = torch.zeros(n, dtype=torch.float32)
        rows: list[dict[str, Any]] = []
        first_error: BaseException | None = None
        num_errors = 0
        for i, (text, source, truth, info) in enumerate(
            zip(texts, data_sources, ground_truths, extra_infos, strict=True)
        ):
            try:
                value, sample_extras = self._call(
                    i, source, text, truth, info, None if uids is None else uids[i]
                )
            except (RewardFunctionError, NonFiniteRewardError):
                raise
            except Exception as exc:
                num_errors += 1
                logger.error(
                    "reward function %s failed on sample %d (data_source=%r): %r; response: %r",
                    self.name,
                    i,
                    source,
                    exc,
                    _truncate(text),
                    # One traceback per batch is enough to debug; the rest would flood the log.
                    exc_info=first_error is None,
                )
                if first_error is None:
                    first_error = exc
                value, sample_extras = 0.0, {}
            scores[i] = value
            rows.append(sample_extras)

        if n > 0 and (num_errors == n or num_errors > self.max_error_fraction * n):
            limit = f"more than custom_reward_function.max_error_fraction={self.max_error_fraction:g} allows"
            raise RewardFunctionError(
                f"the reward function {self.name} failed on {'all' if num_errors == n else num_errors} of "
                f"the batch's {n} samples ({'nothing to train on' if num_errors == n else limit}); first "
                f"error: {first_error!r}. Fix the function (the log names each sample)"
                + ("." if num_errors == n else ", or raise the fraction to train on them scored 0.0.")
            ) from first_error
        return RewardOutput.from_rows(scores, rows, num_errors)


class _Worker:
    """One daemon thread that runs reward calls one at a time, so the caller can stop waiting."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="reward-function", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            fn = self._jobs.get()
            try:
                self._results.put(("ok", fn()))
            except SystemExit as exc:
                self._results.put(("exit", exc))
            except BaseException as exc:  # handed to the caller, which decides
                self._results.put(("error", exc))

    def run(self, fn: Callable[[], Any], timeout: float | None) -> tuple[str, Any]:
        self._jobs.put(fn)
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return "timeout", None


class RewardFunctionError(LaunchError):
    """A reward function hung past its timeout, exited the process, or failed on more samples of a batch
    than custom_reward_function.max_error_fraction allows (one line, on the failing rank)."""
