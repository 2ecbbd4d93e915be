"""One episode's state and the pieces that build its token stream (rollout/agent): the chat-template
encoder of new turns (:class:`TurnEncoder`), the cut of long tool replies, the checks on rewards, and
how a failure on the rank that runs the episodes travels to the ranks it serves.

    Episode.tokens   response so far: model turns (mask 1) and tool/user turns (mask 0), as token ids
    Episode.messages the conversation as messages (the interaction reads it)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from megatron_rl.errors import LaunchError, NonFiniteRewardError
from megatron_rl.rollout.agent.tool_formats import ToolCall
from megatron_rl.rollout.base import EngineDied, EngineFailure, RolloutOOMError

_SURROGATE = re.compile("[\ud800-\udfff]")
_MARK = "MRLASSISTANTMARK"  # the assistant content of the probe conversation (found again in its text)


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
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token (tool and user tokens: the one current when they were
    appended)."""
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
    seed_key: tuple[int, int] = (0, 0)
    """(dp_rank, row) of its response row (prompt i, sample j -> row i*n + j): with the turn, its seeds."""
    seed_step: int | None = None
    """The step whose seeds its turns use (partial rollouts: the step it started); None: the run's."""
    run_s: float = 0.0
    """Seconds from its first turn's submission to its end (with its tools' final rewards), summed over
    the runs it took part in (partial rollouts: not the steps' training between them)."""


def clean_row(d: Any) -> Any:
    """Parquet structs hold the union of the rows' keys, None where a row had none: drop those."""
    if isinstance(d, dict):
        return {k: clean_row(v) for k, v in d.items() if v is not None}
    return d


Failure = tuple[str, str]
"""A failure as it travels from the rank that ran the episodes to the ranks it serves: (kind, message),
kind one of launch (a one-line LaunchError), oom, engine (the engine died: the supervisor restarts
it) or error."""


def failure_of(exc: BaseException) -> Failure:
    """``exc`` as a :data:`Failure`."""
    if isinstance(exc, LaunchError):
        return "launch", str(exc)
    if isinstance(exc, RolloutOOMError):
        return "oom", str(exc)
    if isinstance(exc, EngineDied | EngineFailure):
        return "engine", f"{type(exc).__name__}: {exc}"
    return "error", f"{type(exc).__name__}: {exc}"


def raise_failure(failure: Failure, rank: int) -> NoReturn:
    """Raise ``failure`` (of global ``rank``'s episodes) on every rank it served, as its kind says."""
    kind, message = failure
    if kind == "launch":
        raise LaunchError(message)
    if kind == "oom":
        raise RolloutOOMError(message)
    if kind == "engine":
        raise EngineFailure(rank, message)
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
