"""Tool-call formats of the agent loop (``actor_rollout_ref.rollout.multi_turn.format``): the text of
one model turn (decoded with its special tokens) -> its tool calls, in order.

    hermes       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the turn
                 (the format of Qwen2.5's and Qwen3's chat templates, Hermes and many others)
    llama3_json  the turn is the call itself: ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3's
                 JSON tool calling), optionally after ``<|python_tag|>``, several separated by ``;``;
                 a turn that does not start with ``{`` is an answer, not a call

A malformed call becomes a :class:`ToolCall` with ``error`` set: the model gets the error back as the
tool's reply, never a crashed step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMATS = ("hermes", "llama3_json")
_LLAMA_END = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None
    """A malformed call: the error message the model gets back instead of a result."""


def _call(obj, args_key: str) -> ToolCall:
    """One decoded JSON value -> a call (or a malformed one naming what is wrong)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, f'a tool call is {{"name": ..., "{args_key}": {{...}}}}')
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f"the tool call's {args_key} are not a JSON object")
    return ToolCall(obj["name"], args)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of ``text``, in order."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg})"))
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
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg})"))
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
