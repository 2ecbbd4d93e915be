"""What goes over the wire of the OpenAI-compatible endpoint (rollout/agent/openai_server.py): the checks a
chat request passes before its session sees it, and the chat.completion a turn is answered with.

    body = parse_body(raw, limits)                # bytes -> dict (else HTTPError 400 naming the field)
    messages, tools = check_chat(body, limits)    # the messages (content as text) and tool specs
    reply = completion(tokenizer, model_name, (episode_id, turn), turn_ids, engine_prompt, finish)

The limits of a request (:class:`EndpointLimits`, its defaults; openai_http.py has those of the
connections); each is a 400 naming the field, never a 500:

    max_json_depth   64 levels of nested arrays/objects in the body (json recurses per level)
    max_int_digits   32 digits in one JSON integer (Python's int() refuses more than 4,300, and costs
                     time quadratic in the digits below that)
    max_messages     1024 chat messages in a request; each message's size is bounded by the body's
                     (max_body_bytes, 413), its rendering by data.max_prompt_length / the response budget
    max_tools        128 tool specs, each {"type": "function", "function": {"name": <non-empty string>,
                     "description": <string>, "parameters": <object>}}
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from megatron_rl.rollout.agent.tool_formats import TOOL_CALL, parse_hermes

_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]', re.S)
"""A JSON string (skipped whole), a bracket or a colon: enough to follow the nesting and the top-level
keys without parsing."""


@dataclass
class EndpointLimits:
    """What one client may ask of the endpoint (the module docstring); None: derived from max_sessions."""

    max_connections: int | None = None
    read_timeout_s: float = 30.0
    max_json_depth: int = 64
    max_int_digits: int = 32
    max_messages: int = 1024
    max_tools: int = 128

    def connections(self, max_sessions: int) -> int:
        """The connection cap: a harness's connection per session, with room for the ones it leaves open
        until read_timeout_s closes them."""
        return self.max_connections or max(256, 4 * max_sessions)

    def check(self) -> None:
        for key in ("max_json_depth", "max_int_digits", "max_messages", "max_tools"):
            if getattr(self, key) < 1:
                raise ValueError(f"EndpointLimits.{key}={getattr(self, key)} must be >= 1")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"EndpointLimits.max_connections={self.max_connections} must be >= 1")
        if not self.read_timeout_s > 0:
            raise ValueError(f"EndpointLimits.read_timeout_s={self.read_timeout_s} must be > 0")


class HTTPError(Exception):
    """A request refused with ``status`` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- the request body ----------------------------------------------------------------------------------


class _BigInt(str):
    """A JSON integer past max_int_digits, kept as its text so the check can name where it is."""


def parse_body(raw: bytes, limits: EndpointLimits) -> dict:
    """The body as a JSON object. Its nesting is measured before parsing (json recurses per level) and
    long integers are kept as text (int() of one costs time quadratic in its digits): either -> 400."""
    try:
        text = raw.decode(json.detect_encoding(raw))
    except UnicodeDecodeError as exc:
        raise HTTPError(400, f"the request body is not UTF-8 text ({exc.reason})") from None
    where = _too_deep(text, limits.max_json_depth)
    if where is not None:
        raise HTTPError(
            400, f"{where} nests arrays/objects deeper than {limits.max_json_depth} levels (max_json_depth)"
        )
    big: list[str] = []

    def parse_int(s: str) -> int | str:
        if len(s) - s.startswith("-") <= limits.max_int_digits:
            return int(s)
        big.append(s)
        return _BigInt(s)

    try:
        body = json.loads(text, parse_int=parse_int)
    except json.JSONDecodeError as exc:
        raise HTTPError(400, f"the request body is not JSON ({exc.msg})") from None
    except RecursionError:  # not reached below max_json_depth; kept as the parser's own bound
        raise HTTPError(400, "the request body nests arrays/objects too deeply") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body is a JSON object")
    if big:
        path, value = _find(body, lambda v: isinstance(v, _BigInt))
        digits = len(value) - value.startswith("-")
        raise HTTPError(
            400,
            f"'{path}' is an integer of {digits} digits, more than {limits.max_int_digits} (max_int_digits)",
        )
    return body


def _too_deep(text: str, limit: int) -> str | None:
    """Where ``text`` nests deeper than ``limit`` ("'<top-level key>'" or "the request body"), or None."""
    if text.count("[") + text.count("{") <= limit:
        return None
    depth, key, last = 0, None, None
    for m in _JSON_TOKEN.finditer(text):
        t = m.group()
        if t[0] == '"':
            last = t
            continue
        if t == ":":
            if depth == 1 and last is not None:
                key = last
        elif t in "[{":
            depth += 1
            if depth > limit:
                if key is None or depth == 1:
                    return "the request body"
                try:
                    return repr(json.loads(key))
                except ValueError:
                    return "the request body"
        else:
            depth -= 1
        last = None
    return None


def _find(obj: Any, hit: Callable[[Any], bool]) -> tuple[str, Any]:
    """The path ("tools[0].function.name") and value of the first value of ``obj`` that ``hit`` accepts."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, v = stack.pop()
        if hit(v):
            return path, v
        if isinstance(v, dict):
            stack += [(f"{path}.{k}" if path else str(k), x) for k, x in reversed(v.items())]
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v)))]
    raise LookupError("no such value")


def check_chat(body: dict, limits: EndpointLimits) -> tuple[list[dict], list[dict] | None]:
    """The request's messages (content as text) and tool specs (None when it has none), or 400 naming
    the field at fault."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list of chat messages")
    if len(messages) > limits.max_messages:
        raise HTTPError(
            400, f"'messages' has {len(messages)} messages, more than {limits.max_messages} (max_messages)"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"'messages[{i}]' must be an object with a string 'role'")
        out.append({**m, "content": _text(m.get("content"), f"messages[{i}].content")})
    return out, _tools(body.get("tools"), limits)


def _text(content: Any, where: str) -> str:
    """OpenAI message content (a string, None, or a list of {"type": "text", "text"} parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text", ""), str):
                raise HTTPError(400, f"'{where}': only text content is supported (parts of type 'text')")
            parts.append(p.get("text", ""))
        return "".join(parts)
    raise HTTPError(400, f"'{where}' must be a string or a list of text parts, got {type(content).__name__}")


_TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'


def _tools(tools: Any, limits: EndpointLimits) -> list[dict] | None:
    """``tools``: absent, null or [] (no tools), else a list of function specs (``_TOOL_SHAPE``)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise HTTPError(400, f"'tools' must be a list of function specs {_TOOL_SHAPE}")
    if len(tools) > limits.max_tools:
        raise HTTPError(400, f"'tools' has {len(tools)} specs, more than {limits.max_tools} (max_tools)")
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise HTTPError(400, f"'{at}' must be a function spec {_TOOL_SHAPE}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise HTTPError(400, f"'{at}.function' must be an object {_TOOL_SHAPE}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise HTTPError(400, f"'{at}.function.name' must be a non-empty string")
        if not isinstance(fn.get("description", ""), str):
            raise HTTPError(400, f"'{at}.function.description' must be a string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise HTTPError(400, f"'{at}.function.parameters' must be a JSON schema object")
    return tools


def completion(
    tok: Any, model: str, ids: tuple[str, int], toks: list[int], engine_prompt: list[int], finish: str
) -> dict:
    """A turn's chat.completion: the model's text (special tokens and parsed Hermes calls removed), its
    calls as ``tool_calls``, and the ids themselves. ``ids``: (episode id, turn) for the reply's ids."""
    episode, turn = ids
    text = tok.decode(toks, skip_special_tokens=False)
    calls = parse_hermes(text)
    tool_calls, spans = [], []
    for k, (m, c) in enumerate(zip(TOOL_CALL.finditer(text), calls, strict=True)):
        if c.error is not None:
            continue  # a malformed call stays in the content, as text
        spans.append(m.span())
        tool_calls.append(
            {
                "id": f"call_{episode}_{turn}_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
        )
    kept = text
    for a, b in reversed(spans):
        kept = kept[:a] + kept[b:]
    # the content without special tokens: the model's text as a chat client expects it
    for t in [t for t in tok.all_special_tokens if t]:
        kept = kept.replace(t, "")
    message: dict[str, Any] = {"role": "assistant", "content": kept.strip() or (None if tool_calls else "")}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": f"chatcmpl-{episode}-{turn}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
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


_T = TypeVar("_T")


def rendered(render: Callable[[], _T]) -> _T:
    """``render()`` (the chat template on a request's messages and tools); a template that cannot render
    them is the request's fault: 400."""
    try:
        return render()
    except HTTPError:
        raise
    except Exception as exc:
        raise HTTPError(
            400,
            f"the chat template cannot render 'messages' / 'tools' ({type(exc).__name__}: {exc})"[:500],
        ) from None
