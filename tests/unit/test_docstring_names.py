"""Every dotted name a docstring of the package gives as code (``a.b``, :func:`a.b`) and every file
path it names exists: a renamed or moved module leaves no stale pointer behind.

Checked: names that start with ``megatron_rl`` or with one of its modules or packages (read as
``megatron_rl.<name>``), resolved by import and attribute lookup; paths under the repository's
top-level folders. Not checked: config keys (``rollout.dtype`` is a key, not a module), file names
(``config.json``), and, in a function's docstring, names that start with one of its parameters
(``batch.responses``)."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re

import megatron_rl
from megatron_rl.config.load import known_keys
from megatron_rl.config.schema import Config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE = re.compile(
    r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``"  # ``a.b`` or ``a.b()``
    r"|:(?:func|class|mod|meth|attr|data):`~?([\w.]+)`"  # :func:`a.b`
)
TOP = "megatron_rl|tests|docs|launch|yaml|ckpt_tools|bench"
PATH = re.compile(rf"\b((?:{TOP})/[\w/.\-]+\.(?:py|md|yaml|sh|sbatch))")
FILE_SUFFIXES = {"json", "jsonl", "parquet", "yaml", "py", "md", "safetensors", "distcp", "pt"}
MODULES = {m.name for m in pkgutil.iter_modules(megatron_rl.__path__)}
KEYS = list(known_keys(Config))


def resolves(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "megatron_rl":
        parts = ["megatron_rl", *parts]
    for i in range(len(parts), 1, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def checked(name: str, params: set[str]) -> bool:
    parts = name.split(".")
    if parts[0] in params or parts[-1] in FILE_SUFFIXES:
        return False
    if any(k == name or k.endswith("." + name) for k in KEYS):
        return False
    return parts[0] == "megatron_rl" or parts[0] in MODULES


def docstrings() -> list[tuple[str, str, set[str]]]:
    """(file, docstring, parameter names) of every module, class and function of the package."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "megatron_rl")):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            with open(path) as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    params: set[str] = set()
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        a = node.args
                        params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
                    doc = ast.get_docstring(node)
                    if doc:
                        out.append((os.path.relpath(path, ROOT), doc, params))
    return out


def test_dotted_names_and_paths_in_docstrings_exist():
    stale = set()
    for file, doc, params in docstrings():
        for m in CODE.finditer(doc):
            name = m.group(1) or m.group(2)
            if checked(name, params) and not resolves(name):
                stale.add(f"{file}: {name}")
        for m in PATH.finditer(doc):
            if "/X." not in m.group(1) and not os.path.exists(os.path.join(ROOT, m.group(1))):
                stale.add(f"{file}: {m.group(1)}")
    assert not stale, "docstrings name what does not exist:\n  " + "\n  ".join(sorted(stale))


def test_the_check_sees_a_stale_name():
    assert resolves("rollout.checksums.tensor_checksum") and resolves("megatron_rl.parallel.init_parallel")
    assert not resolves("rollout.remote") and not resolves("megatron_rl.rollout.base.NoSuchThing")
    assert not checked("rollout.dtype", set())  # a config key
    assert not checked("batch.responses", {"batch"})  # a parameter's attribute
    assert checked("roles.remote_rollout", set())
