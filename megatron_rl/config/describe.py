"""The key reference (``python -m megatron_rl.config --keys [PREFIX]``) and a resolved-config printer
without checks (:func:`main`). ``python -m megatron_rl.config`` itself is the dry run of a launch
(:func:`megatron_rl.run.preflight.main`): it also runs the trainer's pre-flight checks, which reach above
this package (devices, model files)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.load import load_config, to_dict
from megatron_rl.config.schema import Config


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (read from this module's source),
    inherited fields included."""
    docs = {}
    for base in reversed(cls.__mro__[:-1]):  # a subclass's fields after its bases'
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    import ast
    import inspect

    class_def = ast.parse(inspect.getsource(cls)).body[0]
    if not isinstance(class_def, ast.ClassDef):  # getsource of a class is its class statement
        raise TypeError(f"{cls.__qualname__}: its source does not start with its class statement")
    body = class_def.body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_keys(prefix: str = "") -> str:
    """Every key under ``prefix`` with its type, default and docstring, section by section."""
    lines: list[str] = []

    def walk(obj: Any, path: str) -> None:
        docs = field_docs(type(obj))
        leaves: list[tuple[dataclasses.Field[Any], Any]] = []  # (field, its value)
        sections: list[tuple[dataclasses.Field[Any], Any]] = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            (sections if dataclasses.is_dataclass(value) else leaves).append((f, value))
        shown = [(f, v) for f, v in leaves if f"{path}{f.name}".startswith(prefix)]
        if shown:
            lines.append(f"[{path[:-1] or 'config'}]")
            for f, v in shown:
                lines.append(f"  {path}{f.name}: {f.type} = {v!r}")
                doc = docs.get(f.name)
                if doc:
                    lines.append(f"      {doc}")
        for f, v in sections:
            walk(v, f"{path}{f.name}.")

    walk(Config(), "")
    return "\n".join(lines)


USAGE = """usage: python -m megatron_rl.config [[--config] FILE.yaml] [key=value ...]
       python -m megatron_rl.config --keys [PREFIX]

Prints the fully resolved config of a run (defaults <- FILE.yaml <- key=value overrides, as
megatron_rl.train resolves it), or with --keys every key (optionally only those starting with
PREFIX) with its type, default and meaning. Keys follow verl's names; `+key=value` works as
`key=value`; a scalar given for a list key becomes a one-element list."""


def main(argv: list[str] | None = None) -> None:
    """Print the fully resolved config:
    ``python -m megatron_rl.config [[--config] file.yaml] [key=value ...]`` (as ``megatron_rl.train``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv and argv[0] == "--keys":
        print(describe_keys(argv[1] if len(argv) > 1 else ""))
        return
    if argv and argv[0] == "--config":
        argv.pop(0)
        if not argv:
            sys.exit("config error: --config needs a YAML file")
    yaml_path = argv.pop(0) if argv and "=" not in argv[0] else None
    from omegaconf import OmegaConf

    try:
        cfg = load_config(yaml_path, argv)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    print(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))), end="")


if __name__ == "__main__":
    main()
