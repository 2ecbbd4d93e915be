"""Safe deserialisation of Megatron checkpoints: no pickle is executed unchecked.

Every ``torch.load`` of a checkpoint is ``weights_only=True`` with the explicit allowlist of
:func:`safe_globals` (:func:`safe_torch_load`); dist_checkpointing's plain-pickle ``.metadata`` is
read by a restricted unpickler first (:func:`read_dcp_metadata`, :func:`check_torch_dist`), and the
model never asks dist_checkpointing for pickled objects (``_extra_state``), which torch's DCP would
unpickle without restriction.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import json
import os
import pickle
import re
from typing import Any

import torch

SAFE_GLOBALS_ENV = "MEGATRON_RL_SAFE_GLOBALS"
"""Comma-separated ``module.Name`` globals to allow in addition to :func:`safe_globals` (opt-in)."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file needs a Python global outside the allowlist; it was not executed."""


def _numpy_globals() -> list:
    """What Megatron-LM's saved RNG states and args need from numpy (both numpy 1 and 2 names)."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    out: list = [np.ndarray, np.dtype]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(multiarray._reconstruct, f"{mod}._reconstruct"), (multiarray.scalar, f"{mod}.scalar")]
    # numpy 2 pickles dtypes through their DType classes (numpy.dtypes.UInt32DType, ...).
    out += list({type(np.dtype(c)) for c in "?bhilqBHILQefdFD"})
    return out


# Modules whose classes run programs, touch files or import code when constructed: never allowed,
# whatever the opt-in says (a class from them is a way to execute a checkpoint, not data).
_NEVER_ALLOWED = (
    "os", "posix", "nt", "sys", "builtins", "shutil", "subprocess", "importlib", "runpy", "ctypes",
    "pickle", "marshal", "socket", "pty", "code", "codeop", "multiprocessing", "threading", "signal",
    "io", "tempfile", "pathlib", "webbrowser", "operator", "functools", "types",
)  # fmt: skip


def _data_class_kind(obj: type) -> str | None:
    """What kind of plain data ``obj`` is (tensor, storage, dtype, numpy array/scalar, enum), or None."""
    import numpy as np

    kinds = (
        ("tensor", (torch.Tensor,)),
        ("storage", (torch.storage.TypedStorage, torch.storage.UntypedStorage)),
        ("dtype", (torch.dtype, torch.Size, np.dtype)),
        ("numpy array", (np.ndarray,)),
        ("numpy scalar", (np.generic,)),
    )
    for kind, bases in kinds:
        if issubclass(obj, bases):
            return kind
    # an enum's values are looked up, not built; one with its own _missing_ hook runs code on a miss
    if (
        issubclass(obj, enum.Enum)
        and getattr(obj._missing_, "__func__", None) is enum.Enum._missing_.__func__
    ):
        return "enum"
    return None


def _user_globals() -> list:
    """The classes named by ``MEGATRON_RL_SAFE_GLOBALS``: tensor, storage, dtype, numpy array/scalar
    and enum classes only (anything else -- a function, a class whose constructor opens files or runs
    code, like zipfile.ZipFile -- is code the unpickler would call), none from a module in
    :data:`_NEVER_ALLOWED`."""
    out = []
    for entry in filter(None, (x.strip() for x in os.environ.get(SAFE_GLOBALS_ENV, "").split(","))):
        module, _, name = entry.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"{SAFE_GLOBALS_ENV}: cannot import {entry!r} ({e})") from None
        homes = {module, getattr(obj, "__module__", "") or ""}
        if (
            not isinstance(obj, type)
            or any(h == m or h.startswith(m + ".") for h in homes for m in _NEVER_ALLOWED)
            or _data_class_kind(obj) is None
        ):
            what = f"a {type(obj).__name__}" if not isinstance(obj, type) else "a class"
            raise ValueError(
                f"{SAFE_GLOBALS_ENV}: refusing {entry}, {what} that is not a tensor, storage, dtype, numpy "
                "array/scalar or enum type (loading a checkpoint would call it: it can run code or touch "
                f"files); remove it from {SAFE_GLOBALS_ENV} and re-save the checkpoint as plain data."
            )
        out.append(obj)
    return out


def safe_globals() -> list:
    """The allowlist for ``torch.load(weights_only=True)`` of Megatron checkpoints.

    megatron-core's own list (argparse.Namespace, numpy arrays for RNG states, megatron enums such
    as AttnBackend/ModelType, OptimizerConfig, rerun-state enums, BytesIO for TE extra states,
    signal.Signals, PosixPath, SimpleNamespace), numpy scalars and dtypes, and whatever the user
    opted into through ``MEGATRON_RL_SAFE_GLOBALS``.
    """
    from megatron.core.safe_globals import SAFE_GLOBALS

    return [*SAFE_GLOBALS, argparse.Namespace, *_numpy_globals(), *_user_globals()]


def _refusal(file: str, detail: str) -> UnsafeCheckpointError:
    m = re.search(r"GLOBAL ([\w.]+)", detail)
    what = f"the global {m.group(1)}, which is not allowed" if m else "an object that is not allowed"
    msg = (
        f"Refusing to load {file}: it contains {what} (megatron-rl loads only what Megatron checkpoints "
        "hold: tensors, argparse.Namespace, numpy RNG states, megatron-core enums). Nothing from the file "
        "was executed. Re-save the checkpoint with a trusted tool (the program that trained it, or "
        "python -m ckpt_tools) so that it holds plain data only."
    )
    if not m:
        msg += f" ({detail.strip().splitlines()[-1]})"
    return UnsafeCheckpointError(msg)


def safe_torch_load(file: str, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with :func:`safe_globals`; anything else is refused.

    ``mmap=True`` maps tensor storage from the file instead of reading it (pages are read on use).
    """
    try:
        with torch.serialization.safe_globals(safe_globals()):
            try:
                return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not mmap or "mmap" not in str(e):
                    raise
                # Files written before torch's zip format cannot be mapped.
                return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(file, str(e)) from None


_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Torch DCP writes ``.metadata`` with plain pickle; allow only its data classes."""

    def __init__(self, file, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        constant = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32, torch.strided, ...
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), constant)):
            return getattr(torch, name)
        if (module, name) in (("torch.serialization", "_get_layout"), ("collections", "OrderedDict")):
            return getattr(importlib.import_module(module), name)
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise _refusal(self.name, f"GLOBAL {module}.{name}")


def read_dcp_metadata(ckpt_dir: str):
    """The ``.metadata`` of a torch_dist checkpoint (tensor keys, global shapes, dtypes), read safely."""
    path = os.path.join(ckpt_dir, ".metadata")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: not a complete torch_dist checkpoint")
    with open(path, "rb") as f:
        return _DcpMetadataUnpickler(f, path).load()


def check_torch_dist(ckpt_dir: str):
    """Vet every pickle of a torch_dist checkpoint before megatron-core opens it.

    Returns (DCP metadata, the common state dict or None). ``common.pt`` goes through
    :func:`safe_torch_load`; tensor data (``*.distcp``) is read by DCP with weights_only=True.
    """
    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        backend = json.load(f).get("sharded_backend")
    if backend != "torch_dist":
        raise ValueError(
            f"{ckpt_dir}/metadata.json: sharded_backend {backend!r}; only torch_dist is supported"
        )
    meta = read_dcp_metadata(ckpt_dir)
    common_file = os.path.join(ckpt_dir, "common.pt")
    common = safe_torch_load(common_file) if os.path.isfile(common_file) else None
    return meta, common


def safe_dist_load(sharded_state_dict: dict, ckpt_dir: str, **kwargs) -> dict:
    """``dist_checkpointing.load`` of a torch_dist directory (an optimizer's, say) after
    :func:`check_torch_dist` vetted its pickles, under :func:`safe_globals`."""
    from megatron.core import dist_checkpointing

    check_torch_dist(ckpt_dir)
    with torch.serialization.safe_globals(safe_globals()):
        return dist_checkpointing.load(sharded_state_dict, ckpt_dir, **kwargs)
