"""Nested dicts seen as dotted keys (``a.b.c``): the one leaf walk that the config's key check
(:mod:`megatron_rl.config`) and the verl key translation (:mod:`megatron_rl.verl_compat`) share."""

from __future__ import annotations

from typing import Any


def leaves(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested dict; an empty dict is a leaf."""
    if not isinstance(d, dict) or not d:
        return [(prefix[:-1], d)] if prefix else []
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        out += leaves(v, f"{prefix}{k}.")
    return out
