"""The tool and interaction classes' former home, kept as an alias of :mod:`megatron_rl.rollout.agent.tools`
(where they live now): tool and interaction configs written before the move name them as
``class_name: megatron_rl.rollout.tools.CalculatorTool``, and scripts import them from here."""

from __future__ import annotations

from megatron_rl.rollout.agent.tools import (
    AnswerCheckInteraction,
    BaseInteraction,
    BaseTool,
    CalculatorTool,
    LookupTool,
    ToolResponse,
)

__all__ = [
    "AnswerCheckInteraction",
    "BaseInteraction",
    "BaseTool",
    "CalculatorTool",
    "LookupTool",
    "ToolResponse",
]
