"""Tool-call formats of the agent loop (``actor_rollout_ref.rollout.multi_turn.format``): the text of
one model turn (decoded with its special tokens) -> its tool calls, in order.

    hermes       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the turn
                 (the format of Qwen2.5's and Qwen3's chat templates, Hermes and many others)
    llama3_json  the turn is the call itself: ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3's
                 JSON tool calling), optionally after ``<|python_tag|>``, several separated by ``;``;
                 a turn that does not start with ``{`` is an answer, not a call

A malformed call becomes a :class:`ToolCall` with ``error`` set: the model gets the error back as the
tool's reply, never a crashed step. The policy writes this text, so before any JSON is decoded a call is
held to :data:`MAX_CALL_CHARS` characters, :data:`MAX_DEPTH` levels of ``[``/``{`` and numbers of at
most :data:`MAX_NUMBER_DIGITS` digits: Python's decoder recurses per level (RecursionError) and refuses
integers over 4,300 digits (ValueError), and a call past a bound gets an error naming it instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMATS = ("hermes", "llama3_json")
_LLAMA_END = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
_PYTHON_TAG = "<|python_tag|>"

MAX_CALL_CHARS = 65536
"""Most characters of one call's JSON (a Llama 3 turn: all of its calls)."""
MAX_DEPTH = 64
"""Most nesting of ``[`` and ``{`` in a call (strings excepted)."""
MAX_NUMBER_DIGITS = 1000
"""Most digits in a row outside strings (one number of a call)."""
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")
_DIGITS = re.compile(rf"[0-9]{{{MAX_NUMBER_DIGITS + 1}}}")


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None
    """A malformed call: the error message the model gets back instead of a result."""


def bound_error(text: str) -> str | None:
    """Why JSON ``text`` is past a bound of this module (docstring), or None when it is within them."""
    if len(text) > MAX_CALL_CHARS:
        return f"the tool call is {len(text)} characters long; at most {MAX_CALL_CHARS} are read"
    bare = _STRING.sub('""', text)  # brackets and digits inside strings do not count
    depth = deepest = 0
    for m in _BRACKETS.finditer(bare):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        return f"the tool call is nested {deepest} levels deep; at most {MAX_DEPTH} are read"
    if _DIGITS.search(bare):
        return (
            f"the tool call has a number of over {MAX_NUMBER_DIGITS} digits; "
            f"at most {MAX_NUMBER_DIGITS} are read"
        )
    return None


class _PastBound(ValueError):
    """Policy-written JSON past a bound of this module (or one the decoder itself refused)."""


def _loads(text: str) -> object:
    """``json.loads`` of policy-written text within the bounds; a ValueError naming what is wrong."""
    error = bound_error(text)
    if error is not None:
        raise _PastBound(error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool call is not valid JSON ({e.msg})") from None
    except (RecursionError, ValueError) as e:  # the bounds should prevent these; still never a crash
        raise _PastBound(f"the tool call cannot be decoded ({type(e).__name__}: {e})") from None


def _call(obj, args_key: str) -> ToolCall:
    """One decoded JSON value -> a call (or a malformed one naming what is wrong)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, f'a tool call is {{"name": ..., "{args_key}": {{...}}}}')
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = _loads(args) if args.strip() else {}
        except _PastBound as e:
            return ToolCall(obj["name"], {}, f"the tool call's {args_key}: {e}")
        except ValueError:
            args = None
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f"the tool call's {args_key} are not a JSON object")
    return ToolCall(obj["name"], args)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of ``text``, in order."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = _loads(body)
        except ValueError as e:
            calls.append(ToolCall("", {}, str(e)))
            continue
        calls.append(_call(obj, "arguments"))
    return calls


def _llama_body(text: str) -> str | None:
    """The turn without its end token and python tag, when it is a call (starts with ``{``)."""
    body = text.strip()
    for end in _LLAMA_END:
        body = body.removesuffix(end).rstrip()
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    return body if body.startswith("{") else None


def parse_llama3_json(text: str) -> list[ToolCall]:
    """The calls of a Llama 3 JSON tool-call turn (module docstring); [] for an answer."""
    body = _llama_body(text)
    if body is None:
        return []
    error = bound_error(body)
    if error is not None:
        return [ToolCall("", {}, error)]
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg})"))
            break
        except (RecursionError, ValueError) as e:  # the bounds should prevent these; still never a crash
            calls.append(ToolCall("", {}, f"the tool call cannot be decoded ({type(e).__name__}: {e})"))
            break
        calls.append(_call(obj, "parameters"))
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
    return calls


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """``text``'s calls in format ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "hermes":
        return parse_hermes(text)
    if fmt == "llama3_json":
        return parse_llama3_json(text)
    raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={fmt!r} is not one of {list(FORMATS)}")


def looks_like_a_call(text: str, fmt: str) -> bool:
    """Whether a turn of a run without tools tries to call one (it then gets an error back)."""
    if fmt == "hermes":
        return "<tool_call>" in text
    return _PYTHON_TAG in text
