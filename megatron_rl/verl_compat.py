"""verl's config keys that this project's config does not hold: aliases, accepted-and-ignored keys and
refused values, so that a verl command line runs unchanged or fails in one line saying why.

:func:`translate` is applied by :func:`megatron_rl.config.load_config` to every layer (YAML file,
command line) before the layer is checked against the dataclasses: an alias is renamed to this
project's key, an ignored key is dropped with a notice, a refused key passes only with the value
this project implements (verl's default, usually). A key that neither verl nor this project knows
still fails with a did-you-mean: the rules apply to verl's keys only (``verl_keys.txt``, the keys of
verl's Megatron PPO trainer config, old and new) and the free-form maps and "+" additions of
verl's scripts (``VERL_FREE_FORM``). The table itself is :mod:`megatron_rl.verl_rules`;
``docs/verl_compat.md`` is it, key by key (``python -m megatron_rl.verl_docs > docs/verl_compat.md``).

Hydra's habits: a config-group choice ``group@package=choice`` (:data:`HYDRA_GROUPS`) is handled in
:func:`translate`; ``--config-path/--config-name`` by :func:`hydra_config_args`, which the entry points
(``megatron_rl.train``, ``python -m megatron_rl.config``) apply before parsing their arguments.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
from typing import Any

from megatron_rl.dotted import leaves
from megatron_rl.verl_rules import (
    DEFAULT_DIFFERENCES,
    HYDRA_GROUPS,
    MEGATRON_ONLY,
    RULES,
    VALUE_REWRITES,
    VERL_BASE_CONFIGS,
    VERL_FREE_FORM,
    Rule,
)

__all__ = [  # the table's names, read from here by the loader and the docs
    "DEFAULT_DIFFERENCES",
    "HYDRA_GROUPS",
    "RULES",
    "VALUE_REWRITES",
    "VERL_BASE_CONFIGS",
    "VERL_FREE_FORM",
    "Rule",
    "compat_table",
    "hydra_config_args",
    "is_verl_key",
    "project_key",
    "rule_for",
    "translate",
    "verl_defaults",
    "verl_key_list",
    "verl_keys",
]

DIFFERENCES_DOC = "docs/verl_compat.md, Defaults that differ from verl's"


def hydra_config_args(argv: list[str], notices: list[str]) -> list[str]:
    """``argv`` with Hydra's ``--config-path P`` / ``--config-name N`` (either ``=`` or space form)
    replaced by ``--config P/N.yaml``. verl's own base configs (``ppo_megatron_trainer``,
    ``ppo_trainer``: Hydra compositions of verl's config groups, named from verl's source tree) are
    dropped with a notice instead: this config's defaults are verl's Megatron trainer's, but for the
    differences of :data:`DEFAULT_DIFFERENCES`. A file that is not there fails in the loader, as a
    missing --config file does."""
    out, path, name, i = [], None, None, 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, val = arg.partition("=")
        if flag in ("--config-path", "--config-name", "-cp", "-cn"):
            if not eq:
                val = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            if flag in ("--config-path", "-cp"):
                path = val
            else:
                name = val
        else:
            out.append(arg)
        i += 1
    if name is None:
        if path is not None:
            notices.append(f"--config-path={path} is ignored: no --config-name names a file in it.")
        return out
    stem = name[:-5] if name.endswith(".yaml") else name
    file = os.path.join(path or ".", stem + ".yaml")
    if os.path.basename(stem) in VERL_BASE_CONFIGS:  # a Hydra composition of verl's, not a config file
        notices.append(
            f"--config-name={name}: verl's {stem}.yaml; this trainer's defaults are those of verl's "
            f"Megatron trainer config but for {len(DEFAULT_DIFFERENCES)} keys ({DIFFERENCES_DOC}; "
            "a YAML file of your own goes in --config)."
        )
        return out
    return ["--config", file, *out]


def _group_choice(key: str, value: Any, source: str, notices: list[str]) -> None:
    """A Hydra config-group choice (``actor@actor_rollout_ref.actor=megatron_actor``): accepted with a
    notice when it names what this trainer runs; ValueError otherwise."""
    allowed = HYDRA_GROUPS.get(key)
    if allowed is None:
        raise ValueError(
            f"{key}={value!r} (from {source}): not one of verl's config groups "
            f"({', '.join(sorted(HYDRA_GROUPS))})."
        )
    if value not in allowed:
        raise ValueError(
            f"{key}={value!r} (from {source}): {MEGATRON_ONLY}, with verl's Megatron trainer defaults "
            f"(accepted: {', '.join(allowed)})."
        )
    notices.append(
        f"{key}={value} is accepted: the section holds verl's Megatron trainer defaults, but for the "
        f"differences listed in {DIFFERENCES_DOC}."
    )


@functools.cache
def verl_key_list() -> tuple[str, ...]:
    """The keys of verl's Megatron PPO trainer config, in its order (verl_keys.txt beside this module)."""
    with open(os.path.join(os.path.dirname(__file__), "verl_keys.txt")) as f:
        return tuple(line.strip() for line in f if line.strip())


@functools.cache
def verl_keys() -> frozenset[str]:
    return frozenset(verl_key_list())


@functools.cache
def verl_defaults() -> dict[str, Any]:
    """verl's default of each key this config shares with verl's Megatron PPO trainer config, under
    verl's name, as verl writes it (``${...}`` interpolations kept); verl_defaults.json beside this
    module, whose ``_source`` names the verl commit."""
    with open(os.path.join(os.path.dirname(__file__), "verl_defaults.json")) as f:
        return json.load(f)["defaults"]


def _alias_target(rule: Rule, key: str) -> str:
    """An alias rule's target for ``key``: the part of the key that the pattern's '*' matched carries
    over ("*.megatron.dtype" -> "*.megatron.params_dtype")."""
    if "*" not in rule.target:
        return rule.target
    head, tail = rule.pattern.split("*", 1)
    return rule.target.replace("*", key[len(head) : len(key) - len(tail)])


def project_key(key: str, known: set[str]) -> str | None:
    """This config's key for verl's ``key``: the same key, or an alias's target; None if it has none."""
    if key in known:
        return key
    rule = rule_for(key)
    if rule is not None and rule.action == "alias" and _alias_target(rule, key) in known:
        return _alias_target(rule, key)
    return None


def is_verl_key(key: str) -> bool:
    """``key`` is in verl's config, or lies under one of its free-form maps (``override_*``, ...)."""
    parts = key.split(".")
    if any(".".join(parts[:i]) in verl_keys() for i in range(len(parts), 0, -1)):
        return True
    return any(fnmatch.fnmatchcase(key, p) for p in VERL_FREE_FORM)


def rule_for(key: str) -> Rule | None:
    """The first rule whose pattern matches ``key``."""
    return next((r for r in RULES if fnmatch.fnmatchcase(key, r.pattern)), None)


def _set(d: dict, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    for p in path:
        d = d.setdefault(p, {})
    d[leaf] = value


def translate(raw: dict, known: set[str], source: str, notices: list[str]) -> dict:
    """``raw`` with verl-only keys handled (module docstring); keys this project knows pass through.

    Raises ValueError (one line, naming the key and why) for a refused value. Appends one notice
    per ignored key to ``notices``.
    """
    out: dict = {}
    for key, value in leaves(raw):
        if isinstance(value, str) and (key, value) in VALUE_REWRITES:
            value, why = VALUE_REWRITES[key, value]
            notices.append(f"{key}: {why}.")
        if "@" in key.split(".", 1)[0]:  # a Hydra group choice: "group@package.path=choice"
            _group_choice(key, value, source, notices)
            continue
        rule = None if key in known or not is_verl_key(key) else rule_for(key)
        if rule is None or rule.action == "transformer":  # transformer: kept in the free-form map
            _set(out, key, value)
        elif rule.action == "alias":
            _set(out, _alias_target(rule, key), value)
        elif rule.action == "refused":
            if value not in rule.allowed:
                allowed = ", ".join(repr(a) for a in rule.allowed) or "none"
                raise ValueError(f"{key}={value!r} (from {source}): {rule.why} (accepted: {allowed}).")
        elif rule.action == "untrained":
            if value in rule.allowed:
                notices.append(f"{key}={value!r} is accepted and ignored: {rule.why}.")
            else:  # kept: the loader's unknown-key error names where the key applies
                _set(out, key, value)
        else:
            notices.append(f"{key} is accepted and ignored: {rule.why}.")
    return out


def compat_table(verl_keys: list[str], known: set[str]) -> str:
    """docs/verl_compat.md: every verl key with what this project does with it."""
    rows = {"implemented": [], "alias": [], "refused": [], "ignored": [], "unclassified": []}
    for key in verl_keys:
        if key in known:
            rows["implemented"].append(f"| `{key}` | same key |")
            continue
        rule = rule_for(key)
        if rule is None:
            rows["unclassified"].append(f"| `{key}` | |")
        elif rule.action == "alias":
            rows["alias"].append(f"| `{key}` | read as `{rule.target}` |")
        elif rule.action == "refused":
            ok = ", ".join(f"`{a}`" for a in rule.allowed) or "none"
            rows["refused"].append(f"| `{key}` | accepted: {ok}; otherwise refused: {rule.why} |")
        elif rule.action == "transformer":
            rows["implemented"].append(f"| `{key}` | passed to megatron-core's TransformerConfig |")
        elif rule.action == "untrained":
            ok = ", ".join(f"`{a}`" for a in rule.allowed)
            rows["ignored"].append(f"| `{key}` | ignored when {ok}; otherwise refused: {rule.why} |")
        else:
            rows["ignored"].append(f"| `{key}` | {rule.why} |")
    titles = {
        "implemented": "Implemented under verl's name",
        "alias": "Implemented under another name",
        "refused": "Accepted only with the value this project implements",
        "ignored": "Accepted and ignored (a one-line notice at start names each one set)",
        "unclassified": "Not classified (refused as unknown keys)",
    }
    out = [
        "# verl config keys",
        "",
        "Every key of verl's Megatron PPO trainer config (v0.7's `ppo_megatron_trainer.yaml` and the",
        "newer `model_engine=megatron` composition) and what megatron-rl does with it. Keys that",
        "neither verl nor megatron-rl knows fail with a did-you-mean. A scalar given for a list key",
        "(`data.train_files=x.parquet`, `trainer.logger=console`) is a one-element list, and `+key=value`",
        "sets `key` like `key=value`. Generated by `python -m megatron_rl.verl_docs` from the key list",
        "in `megatron_rl/verl_keys.txt`. verl's own Megatron example command lines, each with its status",
        "here (resolves, or the feature that refuses it): [verl_scripts.md](verl_scripts.md).",
        "",
    ]
    for name, title in titles.items():
        if rows[name]:
            out += [f"## {title} ({len(rows[name])})", "", "| key | here |", "| --- | --- |", *rows[name], ""]
    return "\n".join(out + _defaults_section(known) + _hydra_section() + _transformer_section())


def _verl_default(value: Any) -> str:
    """verl's default as the docs show it: an interpolation of one key is that key's value."""
    m = re.fullmatch(r"\$\{(?:oc\.select:)?([^,}]+)(?:,.*)?\}", value) if isinstance(value, str) else None
    if m:
        return f"the value of `{m.group(1)}`"
    return f"`{json.dumps(value)}`"


def _defaults_section(known: set[str]) -> list[str]:
    verl = {project_key(k, known): (k, v) for k, v in verl_defaults().items()}
    rows = []
    for key, diff in DEFAULT_DIFFERENCES.items():
        verl_key, value = verl[key]
        name = f"`{key}`" if key == verl_key else f"`{key}` (verl: `{verl_key}`)"
        rows.append(f"| {name} | {_verl_default(value)} | `{json.dumps(diff.here)}` | {diff.why} |")
    return [
        f"## Defaults that differ from verl's ({len(rows)})",
        "",
        f"Of the {len(verl)} keys both configs have, these defaults are not those of verl's Megatron PPO",
        "trainer config (`megatron_rl/verl_defaults.json`, read from verl's source; its `_source` names",
        "the commit); every other key's default is verl's.",
        "",
        "| key | verl's default | here | why |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
    ]


def _hydra_section() -> list[str]:
    groups = [f"| `{g}` | {', '.join(f'`{c}`' for c in choices)} |" for g, choices in HYDRA_GROUPS.items()]
    return [
        "## verl's Hydra habits",
        "",
        "- `model_engine=megatron` and `actor_rollout_ref.actor.model_engine=megatron` are accepted;",
        f"  any other engine is refused ({MEGATRON_ONLY}).",
        "- `--config-path P --config-name N` (or `=` forms) load `P/N.yaml` when it exists. verl's own",
        f"  base configs ({', '.join(f'`{c}`' for c in VERL_BASE_CONFIGS)}) are dropped with a notice:",
        "  this config's defaults are verl's Megatron trainer's, but for the differences listed above.",
        "- `+key=value` sets `key` like `key=value`, for this config's keys, verl's keys and the keys",
        "  verl's scripts add with `+` (`trainer.val_only`, `override_transformer_config.*`, ...).",
        "- Config-group choices (`group@package=choice`): the choice that means what this trainer runs is",
        "  accepted with a notice, any other refused in one line.",
        "",
        "| group@package | accepted |",
        "| --- | --- |",
        *groups,
        "",
    ]


def _transformer_section() -> list[str]:
    prefix = "*.megatron.override_transformer_config."
    rows = []
    for r in RULES:
        if not r.pattern.startswith(
            ("*.megatron.override_transformer_config.", "*.override_transformer_config.")
        ):
            continue
        key = r.pattern.split("override_transformer_config.", 1)[1]
        if r.action == "alias":
            here = f"read as `{r.target}`"
        elif r.action == "refused":
            ok = ", ".join(f"`{a}`" for a in r.allowed) or "none"
            here = f"accepted: {ok}; otherwise refused: {r.why}"
        elif key == "moe_grouped_gemm":
            here = "kept: grouped-matmul experts (default true; false: one MLP per expert; MoE models only)"
        elif key == "transformer_impl":
            here = (
                "kept: the layer spec, `transformer_engine` (the default where Transformer Engine imports) "
                "or `local` (otherwise; MLA and LoRA models too)"
            )
        elif key.startswith("fp8"):
            here = (
                "kept: FP8 training of the linear layers (megatron-core's `fp8`: `e4m3`, `hybrid`; "
                "`fp8_recipe`: `delayed`, `tensorwise`, `mxfp8`, `blockwise`) on Transformer Engine's "
                "layers; refused on the local ones"
            )
        elif r.action == "transformer" and key.startswith("moe_"):
            here = "kept: read by the MoE layers' router (MoE models only)"
        elif r.action == "transformer":
            here = "kept: passed to megatron-core's TransformerConfig"
        else:
            here = f"accepted and ignored: {r.why}"
        rows.append(f"| `{key}` | {here} |")
    return [
        f"## `{prefix}*` (first matching row)",
        "",
        "Kept keys land in the section's `megatron.override_transformer_config` map.",
        "",
        "| key | here |",
        "| --- | --- |",
        *rows,
        "",
    ]
