"""Tools and interactions of multi-turn rollouts, in verl's shapes and config files.

A tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) is verl's YAML::

    tools:
      - class_name: megatron_rl.rollout.agent.tools.CalculatorTool   # any importable BaseTool-shaped class
        config: {type: native}                                 # handed to the class; "mcp" is refused
        tool_schema: {type: function, function: {name: calc, description: ..., parameters: {...}}}

An interaction config (``multi_turn.interaction_config_path``) is verl's too::

    interaction:
      - name: gsm8k                        # a row picks it in extra_info.interaction_kwargs.name
        class_name: megatron_rl.rollout.agent.tools.AnswerCheckInteraction
        config: {}

A tool's life in one episode (per call, as verl's tool agent loop does it):
``create(create_kwargs=extra_info.tools_kwargs[name].create_kwargs)`` -> ``execute(instance_id,
arguments)`` -> ``(response, step_reward, metrics)`` -> ``calc_reward(instance_id)`` -> ``release``.
The methods may be coroutines (verl's are) or plain functions; :func:`call` runs either. verl's own
classes (``verl.tools.*``) load unchanged where verl is installed: their schema is then built with
verl's pydantic model, as they expect.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict
from uuid import uuid4

from megatron_rl.config import ConfigError


@dataclass
class ToolResponse:
    """What a tool returns to the conversation (verl's ToolResponse; text only here)."""

    text: str | None = None
    image: list | None = None
    video: list | None = None


def call(fn, *args, **kwargs):
    """Call ``fn``; run the coroutine it returns, if any, to completion (in this thread)."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):

        async def wait():
            return await out

        return asyncio.run(wait())
    return out


def response_text(resp: Any) -> str:
    """The text of a tool's response: a ToolResponse (ours or verl's), a str, a dict with "text"."""
    if resp is None:
        return ""
    if isinstance(resp, str):
        return resp
    if isinstance(resp, dict):
        return str(resp.get("text") or "")
    if getattr(resp, "image", None) or getattr(resp, "video", None):
        raise ValueError("tool returned images or video; multi-turn rollouts here are text only")
    return str(getattr(resp, "text", "") or "")


def schema_dict(schema: Any) -> dict:
    """A tool schema as a plain OpenAI-function dict (ours are dicts; verl's are pydantic models)."""
    if isinstance(schema, dict):
        return schema
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    raise TypeError(f"tool schema {schema!r} is neither a dict nor a pydantic model")


class BaseTool:
    """verl's tool interface: ``create`` / ``execute`` / ``calc_reward`` / ``release`` per episode.

    ``tool_schema`` is the OpenAI function schema (a dict); ``name`` is its ``function.name``, the
    name a model calls. Subclasses keep per-instance state keyed by ``instance_id``.
    """

    def __init__(self, config: dict, tool_schema: dict | None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if not self.tool_schema:
            raise ValueError(f"{type(self).__name__}: no tool_schema given and none built in")
        self.name = schema_dict(self.tool_schema)["function"]["name"]

    def get_openai_tool_schema(self) -> dict | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start an instance for one episode; ``kwargs["create_kwargs"]``: the row's tools_kwargs."""
        return instance_id or uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[Any, float, dict]:
        """Run the call: (response, step reward, metrics)."""
        return ToolResponse(text=""), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The reward of the instance's state (after execute)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Drop the instance's state."""


class BaseInteraction:
    """verl's interaction interface: a simulated user that answers each assistant turn."""

    def __init__(self, config: dict):
        self.config = dict(config or {})
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or uuid4().hex

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(end the episode, the user's reply, this turn's score, extra data)."""
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        """Release the instance's state."""


class TurnResult(TypedDict):
    """What one episode's tool calls or interaction gave it in a turn (the agent loop's DP leader runs
    them and broadcasts these to its TP/PP peers)."""

    stats: dict[str, float]
    tool_rewards: list[float]
    turn_scores: list[float]
    messages: list[dict]
    terminate: bool
    interaction_id: NotRequired[str | None]
    instances: NotRequired[dict[str, str]]  # tool name -> instance id, for tools first called this turn
    ids: NotRequired[list[int]]  # the messages as token ids (added once they are encoded)


# --------------------------------------------------------------------------------------------------
# Built-in tools
# --------------------------------------------------------------------------------------------------

_OPS: dict[type[ast.AST], Callable[..., Any]] = {  # binary and unary operators alike
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


MAX_RESULT_BITS = 4096
"""Largest integer the calculator computes (about 1,233 decimal digits), checked before each operation."""
MAX_EXPONENT = 64
"""Largest |exponent| of ``**``."""


def _checked(op: ast.AST, left: Any, right: Any) -> Any:
    """``left op right``, refused before it is computed when an integer result could pass
    MAX_RESULT_BITS: big-integer arithmetic holds the GIL, so a timeout cannot stop it once started."""
    if isinstance(left, int) and isinstance(right, int):
        a, b = abs(left).bit_length(), abs(right).bit_length()
        if isinstance(op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ValueError(f"an exponent over {MAX_EXPONENT} is past the calculator's limit")
            bits = a * right if a > 1 else a  # 0, 1 and -1 stay small
        elif isinstance(op, ast.Mult):
            bits = a + b
        else:  # + - / // %: at most one bit more than the larger operand
            bits = max(a, b) + 1
        if bits > MAX_RESULT_BITS:
            raise ValueError(
                f"the result would have about {bits} bits; the calculator's limit is {MAX_RESULT_BITS} "
                "bits (about 1233 digits)"
            )
    elif isinstance(op, ast.Pow) and abs(right) > MAX_EXPONENT:
        raise ValueError(f"an exponent over {MAX_EXPONENT} is past the calculator's limit")
    value = _OPS[type(op)](left, right)
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    return value


def safe_arithmetic(expression: str, max_len: int = 200) -> float:
    """Evaluate + - * / // % ** and parentheses over numbers; anything else, and a result past
    MAX_RESULT_BITS or an exponent past MAX_EXPONENT, is a ValueError naming the limit."""
    if len(expression) > max_len:
        raise ValueError(f"expression longer than {max_len} characters")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _checked(node.op, ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    return ev(ast.parse(expression.replace("^", "**"), mode="eval"))


class CalculatorTool(BaseTool):
    """``calc(expression)``: the value of an arithmetic expression (no names, no calls)."""

    def __init__(self, config: dict, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)

    def get_openai_tool_schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
                    "required": ["expression"],
                },
            },
        }

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[Any, float, dict]:
        value = safe_arithmetic(str(parameters.get("expression", "")))
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return ToolResponse(text=str(value)), 0.0, {}


class LookupTool(BaseTool):
    """``lookup()``: the value the row put in ``tools_kwargs.<name>.create_kwargs.value``; its
    calc_reward is 1.0 once the episode has called it (config ``reward``: the value of that)."""

    def __init__(self, config: dict, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._values: dict[str, Any] = {}
        self._called: set[str] = set()

    def get_openai_tool_schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": "lookup", "description": "Look up this question's value.", "parameters": {}},
        }

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid4().hex
        create_kwargs = kwargs.get("create_kwargs") or {}
        if "value" not in create_kwargs:
            raise ValueError(
                f"{self.name}: the row's extra_info.tools_kwargs.{self.name}.create_kwargs has no 'value'"
            )
        self._values[instance_id] = create_kwargs["value"]
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[Any, float, dict]:
        self._called.add(instance_id)
        return ToolResponse(text=str(self._values[instance_id])), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return float(self.config.get("reward", 1.0)) if instance_id in self._called else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._values.pop(instance_id, None)
        self._called.discard(instance_id)


class AnswerCheckInteraction(BaseInteraction):
    """A user that checks the last assistant message against ``interaction_kwargs.ground_truth``:
    "correct" ends the episode with score 1; otherwise it asks to try again (score 0)."""

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        last = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        truth = str(kwargs.get("ground_truth", "")).strip()
        if truth and truth in last:
            return True, "correct", 1.0, {}
        return False, str(self.config.get("retry_text", "try again")), 0.0, {}


# --------------------------------------------------------------------------------------------------
# Loading verl's config files
# --------------------------------------------------------------------------------------------------


def _import_class(dotted: str, where: str):
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ConfigError(
            f"{where}: class_name={dotted!r} must be a dotted path, "
            "e.g. megatron_rl.rollout.agent.tools.CalculatorTool"
        )
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"{where}: class_name={dotted!r} cannot be imported ({e}); install its package or fix the path"
        ) from None


def _read_yaml(path: str, key: str, section: str) -> list:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml.error import YAMLError

    where = f"actor_rollout_ref.rollout.multi_turn.{key}={path!r}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (YAMLError, OmegaConfBaseException, UnicodeDecodeError, ValueError) as e:
        why = " ".join(str(e).split())  # the parser's message and position, on one line
        raise ConfigError(f"{where} is not a valid YAML file ({why}); fix it (verl's format).") from None
    entries = data.get(section) if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: expected a top-level '{section}:' list (verl's format)")
    return entries


def load_tools(path: str) -> dict[str, Any]:
    """verl's tool config -> {function name: tool instance}."""
    tools: dict[str, Any] = {}
    for i, entry in enumerate(_read_yaml(path, "tool_config_path", "tools")):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(f"{where} needs class_name, config and tool_schema")
        config = dict(entry.get("config") or {})
        kind = str(config.get("type", "native")).lower()
        if kind != "native":
            raise ConfigError(
                f"{where}: config.type={kind!r}: only native tools are built (MCP tools are not)"
            )
        cls = _import_class(entry["class_name"], where)
        schema = entry.get("tool_schema")
        if cls.__module__.startswith("verl.") and schema is not None:  # verl's classes expect its model
            from verl.tools.schemas import OpenAIFunctionToolSchema

            schema = OpenAIFunctionToolSchema.model_validate(schema)
        try:
            tool = cls(config=config, tool_schema=schema)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {entry['class_name']} could not be built ({e})") from None
        if tool.name in tools:
            raise ConfigError(f"{where}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def load_interactions(path: str) -> dict[str, Any]:
    """verl's interaction config -> {name: interaction instance}."""
    out: dict[str, Any] = {}
    for i, entry in enumerate(_read_yaml(path, "interaction_config_path", "interaction")):
        where = f"{path}: interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(f"{where} needs name, class_name and config")
        cls = _import_class(entry["class_name"], where)
        config = dict(entry.get("config") or {})
        name = entry.get("name") or config.get("name") or cls.__name__
        config.setdefault("name", name)
        out[name] = cls(config)
    return out


def check_multi_turn_files(mt) -> None:
    """The tool and interaction configs of ``mt`` (the multi_turn section) read and build as the
    trainer's agent loop builds them: the pre-flight's check, so that a broken file is one line before
    any model is built."""
    if not mt.enable:
        return
    if mt.tool_config_path:
        load_tools(mt.tool_config_path)
    if mt.interaction_config_path:
        load_interactions(mt.interaction_config_path)


def prompt_tool_schemas(mt) -> list[dict] | None:
    """The tools' schemas for the prompts' chat template (``multi_turn``: the config section), or None."""
    if not (mt.enable and mt.tool_config_path):
        return None
    return [schema_dict(t.tool_schema) for t in load_tools(mt.tool_config_path).values()]
