"""Rule rewards: response token ids -> decoded text -> per-sequence scores.

Data flow (one PPO step):

    RewardManager(tokenizer, compute_score)(response_ids, data_sources, ground_truths, extra_infos)
        decodes each response (special tokens skipped), calls
        compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)
        and returns a float32 tensor [B] of sequence scores plus a metrics dict. The trainer places each
        score on the sequence's last response token.

``compute_score`` has verl's custom-reward signature, so verl reward files load unchanged through
``load_custom_reward_function(custom_reward_function.path, custom_reward_function.name)``. It may return a
number or a dict with a "score" key (its other numeric keys are averaged into the metrics).

Built in (``default_compute_score`` dispatches on ``data_source``):
    "openai/gsm8k", "gsm8k"   -> compute_score_gsm8k (strict "#### <number>" format)
    toy.TOY_DATA_SOURCE       -> toy.toy_compute_score (the CPU demo's task)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import numbers
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.toy import TOY_DATA_SOURCE, toy_compute_score

logger = logging.getLogger(__name__)

GSM8K_DATA_SOURCES = ("openai/gsm8k", "gsm8k")

# Only the tail of a response is searched, so an answer-shaped number that the model wrote early in a
# long (possibly degenerate) response does not count.
_SOLUTION_CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### \$?(-?[0-9.,]+)")
_NUMBER_RE = re.compile(r"-?[0-9.,]+")


def _normalize_number(text: str) -> str:
    text = text.replace(",", "").replace("$", "")
    # A sentence-ending period ("#### 72.") is punctuation, not part of the number.
    return text.rstrip(".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final numeric answer in a GSM8K response, or None.

    strict: the number right after the last "#### " (an optional "$" is allowed).
    flexible: the last number anywhere.
    Both look only at the last 300 characters and drop thousands separators "," and "$".
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_SOLUTION_CLIP_CHARS:]
    matches = (_STRICT_RE if method == "strict" else _NUMBER_RE).findall(tail)
    for match in reversed(matches):
        answer = _normalize_number(match)
        # Runs of punctuation alone ("...", ",") match the pattern but are not numbers.
        if any(ch.isdigit() for ch in answer):
            return answer
    return None


def compute_score_gsm8k(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong but extractable one, else 0."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == _normalize_number(str(ground_truth).strip()) else format_score


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
        f"{[*GSM8K_DATA_SOURCES, TOY_DATA_SOURCE]}). Write a function "
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


class RewardManager:
    """Scores decoded responses with ``compute_score``, one float per sequence.

    A sample whose reward function raises (or returns a non-finite or non-numeric value) is logged with
    its index, data_source and response, scores 0.0, and is counted in ``info["reward/num_errors"]``.
    If every sample of a batch fails, the reward function is broken rather than unlucky, and training on
    all-zero rewards would waste the run, so a RuntimeError is raised from the first exception.
    """

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        reward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score
        self.reward_kwargs = dict(reward_kwargs or {})

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
        extras: dict[str, float] = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise KeyError(f"reward function returned a dict without 'score': {sorted(result)}")
            extras = {
                k: float(v)
                for k, v in result.items()
                if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))
            }
            result = result["score"]
        if isinstance(result, torch.Tensor):
            result = result.item()
        if not isinstance(result, numbers.Real):
            raise TypeError(f"reward function returned {type(result).__name__}, expected a number")
        value = float(result)
        if not math.isfinite(value):
            raise ValueError(f"reward function returned {value}")
        return value, extras

    def __call__(
        self,
        response_ids: Sequence[Sequence[int]],
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict[str, Any] | None] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
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
        first_error: BaseException | None = None
        num_errors = 0
        extras_sum: dict[str, float] = defaultdict(float)
        extras_count: dict[str, int] = defaultdict(int)
        per_source: dict[str, list[float]] = defaultdict(list)
        for i, (text, source, truth, info) in enumerate(
            zip(texts, data_sources, ground_truths, extra_infos, strict=True)
        ):
            try:
                value, extras = self._score_one(source, text, truth, info)
            except Exception as exc:
                num_errors += 1
                logger.error(
                    "reward function failed on sample %d (data_source=%r): %r; response: %r",
                    i,
                    source,
                    exc,
                    _truncate(text),
                    # One traceback per batch is enough to debug; the rest would flood the log.
                    exc_info=first_error is None,
                )
                if first_error is None:
                    first_error = exc
                value, extras = 0.0, {}
            scores[i] = value
            per_source[source].append(value)
            for k, v in extras.items():
                extras_sum[k] += v
                extras_count[k] += 1

        if n > 0 and num_errors == n:
            raise RuntimeError(
                f"the reward function failed on all {n} samples of the batch; first error: {first_error!r}"
            ) from first_error

        info: dict[str, float] = {
            "reward/num_errors": float(num_errors),
            "reward/mean": float(scores.mean()) if n else 0.0,
        }
        if len(per_source) > 1:
            for source, values in per_source.items():
                info[f"reward/{source}/mean"] = sum(values) / len(values)
        for k, total in extras_sum.items():
            info[f"reward/{k}/mean"] = total / extras_count[k]
        return scores, info
