"""Megatron checkpoints on disk: megatron-core ``torch_dist`` and legacy Megatron-LM ``torch`` files.

Two formats, two access paths:

* **torch_dist** (megatron.core.dist_checkpointing): :func:`save_torch_dist` / :func:`load_torch_dist`
  go through the model's own ``sharded_state_dict()``; the files hold global tensors (layers stacked
  on a leading axis, fused layouts already TP-independent), so a checkpoint saved at one TP x PP
  loads at any other. :class:`TorchDistReader` reads the same files one layer at a time, without a
  model, and presents them as HF tensors (for ``mcore-to-hf``).
* **legacy** (``latest_checkpointed_iteration.txt``, ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``):
  every file is one TP shard of one pipeline stage with LOCAL layer indices. :class:`LegacyReader`
  merges the TP shards of one parameter into full HF tensors with ``scatter_shard`` (a legacy shard
  of ``linear_qkv`` / ``linear_fc1`` has exactly the layout that ``param_layouts`` gives for its TP
  rank), keeping about one layer in memory; :func:`save_legacy` goes the other way with
  ``assemble_shard``. Both readers expose ``HFReader``'s interface (``read(piece, dim)``, ``get``,
  ``keys``), so every consumer of HF tensors (model filling, HF export, legacy export) works on any
  source through the one layout mechanism of ``weights/tables.py``.

Safety: no pickle is executed unchecked. Every ``torch.load`` here is ``weights_only=True`` with the
explicit allowlist of :func:`safe_globals`; dist_checkpointing's plain-pickle ``.metadata`` is read by
a restricted unpickler first, and the model never asks dist_checkpointing for pickled objects
(``_extra_state``), which torch's DCP would unpickle without restriction.

Our own metadata (``megatron_rl.json``: the HF config, the role, the layout it was saved at) is
written beside every torch_dist checkpoint, so the architecture is known without guessing.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import json
import os
import pickle
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_rl.models.hf import HF_ARCHITECTURES, LLAMA3_FIXED, ModelArgs, model_args_from_hf_config
from megatron_rl.parallel import ParallelState
from megatron_rl.weights.hf_io import assemble_shard, hf_names, scatter_shard
from megatron_rl.weights.tables import (
    ParamLayout,
    Piece,
    hf_shapes,
    iter_stage_layouts,
    layer_index,
    local_layer_name,
    param_layouts,
)

METADATA_FILE = "megatron_rl.json"
"""Written beside our torch_dist checkpoints: {"hf_config", "role", "tp", "pp", "dtype", ...}."""
TRACKER_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
SAFE_GLOBALS_ENV = "MEGATRON_RL_SAFE_GLOBALS"
"""Comma-separated ``module.Name`` globals to allow in addition to :func:`safe_globals` (opt-in)."""

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")

# Megatron-LM checkpoints made with Transformer Engine fuse the pre-attention / pre-MLP norms into
# the next linear layer; megatron-core's sharded_state_dict uses those names for the local spec too.
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file needs a Python global outside the allowlist; it was not executed."""


class TensorSource(Protocol):
    """HF tensors by name, or by :class:`Piece` (rows, or columns for ``dim == 1``): ``HFReader``,
    :class:`LegacyReader`, :class:`TorchDistReader`."""

    def keys(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def read(self, piece: Piece, dim: int | None) -> torch.Tensor: ...


# --------------------------------------------------------------------------------------------------
# Safe deserialisation
# --------------------------------------------------------------------------------------------------


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


def _user_globals() -> list:
    """The classes named by ``MEGATRON_RL_SAFE_GLOBALS``: classes only (a function or other callable
    is code the unpickler would call), and none from a module in :data:`_NEVER_ALLOWED`."""
    out = []
    for entry in filter(None, (x.strip() for x in os.environ.get(SAFE_GLOBALS_ENV, "").split(","))):
        module, _, name = entry.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"{SAFE_GLOBALS_ENV}: cannot import {entry!r} ({e})") from None
        if not isinstance(obj, type):
            raise ValueError(
                f"{SAFE_GLOBALS_ENV}: {entry} is a {type(obj).__name__}, not a class; only plain data "
                f"classes can be allowed: remove it from {SAFE_GLOBALS_ENV}."
            )
        homes = {module, getattr(obj, "__module__", "") or ""}
        if any(h == m or h.startswith(m + ".") for h in homes for m in _NEVER_ALLOWED):
            raise ValueError(
                f"{SAFE_GLOBALS_ENV}: {entry} comes from {obj.__module__}, whose classes can run code or "
                f"touch files when a checkpoint is loaded: remove it from {SAFE_GLOBALS_ENV}."
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


# --------------------------------------------------------------------------------------------------
# Locating checkpoints
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointLocation:
    format: str
    """"torch_dist" or "legacy"."""
    root: str
    """The directory the user named."""
    ckpt_dir: str
    """The dist_checkpointing directory, or the iteration directory holding ``mp_rank_*``."""
    iteration: int | None


_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def _is_torch_dist_dir(d: str) -> bool:
    f = os.path.join(d, "metadata.json")
    if not os.path.isfile(f):
        return False
    try:
        with open(f) as fh:
            return "sharded_backend" in json.load(fh)
    except (OSError, ValueError):
        return False


def _has_rank_dirs(d: str) -> bool:
    return os.path.isdir(d) and any(_RANK_DIR.match(x) for x in os.listdir(d))


def locate_megatron_checkpoint(path: str) -> CheckpointLocation | None:
    """Resolve ``path`` to a Megatron checkpoint (a torch_dist dir, an iteration dir of legacy
    shards, or a Megatron-LM save dir with its tracker file); None if it is none of them."""
    if _is_torch_dist_dir(path):
        return CheckpointLocation("torch_dist", path, path, None)
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            it_dir, iteration = os.path.join(path, "release"), 0
        elif text.isdigit():
            iteration = int(text)
            it_dir = os.path.join(path, f"iter_{iteration:07d}")
        else:
            raise ValueError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
        if _is_torch_dist_dir(it_dir):
            return CheckpointLocation("torch_dist", path, it_dir, iteration)
        if _has_rank_dirs(it_dir):
            return CheckpointLocation("legacy", path, it_dir, iteration)
        raise FileNotFoundError(
            f"{tracker} names iteration {text!r}, but {it_dir} holds neither a torch_dist checkpoint "
            "(metadata.json) nor legacy shards (mp_rank_*/model_optim_rng.pt)"
        )
    if _has_rank_dirs(path):
        m = re.match(r"^iter_(\d+)$", os.path.basename(os.path.normpath(path)))
        return CheckpointLocation("legacy", path, path, int(m.group(1)) if m else None)
    return None


def read_our_metadata(loc: CheckpointLocation) -> dict | None:
    for d in dict.fromkeys((loc.ckpt_dir, loc.root)):
        f = os.path.join(d, METADATA_FILE)
        if os.path.isfile(f):
            with open(f) as fh:
                return json.load(fh)
    return None


# --------------------------------------------------------------------------------------------------
# Megatron-LM args <-> ModelArgs
# --------------------------------------------------------------------------------------------------

_ARCH_CLASS = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}


def hf_config_for(
    arch: str,
    *,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_position_embeddings: int,
    rope_theta: float,
    norm_eps: float,
    tie_embeddings: bool,
    dtype: str = "float32",
) -> dict:
    """An HF config.json (as a dict) for a Llama-family architecture with these dimensions."""
    cfg = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": ffn_hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rms_norm_eps": norm_eps,
        "tie_word_embeddings": tie_embeddings,
        "hidden_act": "silu",
        "dtype": dtype,
    }
    if arch != "qwen2":
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def model_args_from_megatron_args(ns: argparse.Namespace, source: str) -> ModelArgs:
    """Map the ``args`` Namespace that Megatron-LM saves in its checkpoints to :class:`ModelArgs`.

    Only Llama-family GPT models map (RMSNorm, SwiGLU, RoPE, no linear biases); anything else
    raises a ValueError naming the offending argument and ``source``.
    """

    def get(*names, default=None):
        for n in names:
            v = getattr(ns, n, None)
            if v is not None:
                return v
        return default

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"{source}: the saved Megatron-LM args describe {what}, which megatron-rl cannot map to an HF "
            "architecture. Put the model's HF config.json beside the checkpoint if it is a Llama/Qwen model."
        )

    for field in ("num_layers", "hidden_size", "num_attention_heads"):
        if get(field) is None:
            raise refuse(f"no {field}")
    if get("num_experts", "num_moe_experts"):
        raise refuse("a mixture of experts (num_experts)")
    if get("multi_latent_attention", default=False):
        raise refuse("multi-latent attention")
    pos = get("position_embedding_type", default="rope" if get("use_rotary_position_embeddings") else None)
    if pos != "rope":
        raise refuse(f"position_embedding_type={pos!r} (need rope)")
    if get("rotary_percent", default=1.0) != 1.0:
        raise refuse("partial RoPE (rotary_percent)")
    if get("rotary_interleaved", default=False):
        raise refuse("interleaved RoPE")
    if get("normalization", default="LayerNorm") != "RMSNorm" or get("apply_layernorm_1p", default=False):
        raise refuse(f"normalization={get('normalization')!r} (need RMSNorm)")
    if not (get("swiglu", default=False) or get("gated_linear_unit", default=False)):
        raise refuse("an MLP without SwiGLU")
    add_bias = get("add_bias_linear")
    if add_bias is None and getattr(ns, "disable_bias_linear", None) is not None:
        add_bias = not ns.disable_bias_linear
    if add_bias:
        raise refuse("biases in the linear layers (add_bias_linear)")
    qkv_bias, qk_norm = bool(get("add_qkv_bias", default=False)), bool(get("qk_layernorm", default=False))
    if qkv_bias and qk_norm:
        raise refuse("both q/k/v biases and q/k layernorm")
    arch = "qwen2" if qkv_bias else "qwen3" if qk_norm else "llama"
    heads, hidden = ns.num_attention_heads, ns.hidden_size
    kv = get("num_query_groups", default=heads) if get("group_query_attention", default=False) else heads
    # The tensors hold padded_vocab_size rows (Megatron-LM pads for TP); HF configs of Llama/Qwen
    # models carry padded sizes too, so the exported model keeps them all.
    vocab = get("padded_vocab_size", "vocab_size")
    if vocab is None:
        raise refuse("no vocabulary size (padded_vocab_size)")
    dtype = get("params_dtype", default=torch.float32)
    dtype_name = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else "float32"
    hf = hf_config_for(
        arch,
        num_layers=ns.num_layers,
        hidden_size=hidden,
        ffn_hidden_size=get("ffn_hidden_size", default=4 * hidden),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=get("kv_channels", default=hidden // heads),
        vocab_size=vocab,
        max_position_embeddings=get("max_position_embeddings", "seq_length", default=4096),
        rope_theta=float(get("rotary_base", default=10000)),
        norm_eps=float(get("norm_epsilon", "layernorm_epsilon", default=1e-5)),
        tie_embeddings=not get("untie_embeddings_and_output_weights", default=False),
        dtype=dtype_name,
    )
    if get("use_rope_scaling", default=False):  # megatron's scaling is Llama 3.x's, factor aside
        factor = float(get("rope_scaling_factor", default=8.0))
        hf["rope_parameters"].update(rope_type="llama3", factor=factor, **LLAMA3_FIXED)
    return model_args_from_hf_config(hf, source)


def megatron_args_from_model_args(
    args: ModelArgs, tp: int, pp: int, padded_vocab_size: int, dtype: torch.dtype, iteration: int = 0
) -> argparse.Namespace:
    """The subset of Megatron-LM's training args that describes the model, as Megatron-LM saves it.

    ``vocab_size`` is left None, as when Megatron-LM derives it from the tokenizer.
    """
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_heads,
        group_query_attention=args.num_kv_heads != args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        seq_length=args.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=args.rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        normalization="RMSNorm",
        norm_epsilon=args.norm_eps,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        untie_embeddings_and_output_weights=not args.tie_embeddings,
        vocab_size=None,
        padded_vocab_size=padded_vocab_size,
        make_vocab_size_divisible_by=128,
        num_experts=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        ckpt_format="torch",
        use_mcore_models=True,
        transformer_impl="local",
        attention_backend=AttnBackend.auto,
        iteration=iteration,
    )


# --------------------------------------------------------------------------------------------------
# Shared helpers for readers and writers
# --------------------------------------------------------------------------------------------------


def fit_vocab(layout: ParamLayout, shard_rows: int, vocab_size: int) -> ParamLayout:
    """The same vocabulary layout for another padding: shard r holds rows [r*n, (r+1)*n) of the padded
    vocabulary, of which only rows < ``vocab_size`` exist in HF (Megatron-LM pads to 128 x TP)."""
    if layout.shard_rows == shard_rows:
        return layout
    name = layout.pieces[0][0].hf_name
    tp = len(layout.pieces)
    if shard_rows * tp < vocab_size:
        raise ValueError(
            f"{layout.name}: checkpoint holds {shard_rows * tp} vocabulary rows, the model config says "
            f"{vocab_size}; the config.json does not belong to this checkpoint"
        )
    pieces = tuple(
        (Piece(name, r * shard_rows, min((r + 1) * shard_rows, vocab_size)),)
        if r * shard_rows < vocab_size
        else ()
        for r in range(tp)
    )
    return ParamLayout(layout.name, layout.dim, shard_rows, pieces)


def shard_shape(layout: ParamLayout, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of one TP shard of a Megatron parameter (HF shapes give the other dimension)."""
    full = shapes[next(pc.hf_name for rank in layout.pieces for pc in rank)]
    if layout.dim is None:
        return full
    if layout.dim == 1:  # row-parallel [out, in / TP]
        return (full[0], layout.shard_rows)
    return (layout.shard_rows, *full[1:])


def _stage_offsets(layers_per_stage: list[int]) -> list[int]:
    offsets = [0]
    for n in layers_per_stage:
        offsets.append(offsets[-1] + n)
    return offsets


# --------------------------------------------------------------------------------------------------
# Legacy Megatron-LM checkpoints
# --------------------------------------------------------------------------------------------------


def _flatten(d: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _normalize_legacy_name(name: str, file: str) -> str | None:
    """Local-spec name of a legacy state-dict entry; None for entries that are not weights."""
    if name.endswith("_extra_state"):
        return None  # TE/FP8 metadata, no weights
    if name.startswith("language_model."):
        raise ValueError(
            f"{file}: pre-mcore Megatron-LM checkpoint (language_model.* names). Convert it to the mcore "
            "layout with Megatron-LM's tools/checkpoint/convert.py (--saver mcore) first."
        )
    m = re.match(r"^(decoder\.layers\.\d+\.)(.*)$", name)
    if m:
        for local, te in TE_NORM_NAMES.items():
            if m.group(2) == te:
                return m.group(1) + local
    return name


class LegacyCheckpoint:
    """The ``mp_rank_*`` files of one iteration of a Megatron-LM ``torch``-format checkpoint.

    Files are opened lazily, memory-mapped (tensors are paged in when used) and vetted by
    :func:`safe_torch_load`.
    """

    def __init__(self, ckpt_dir: str) -> None:
        self.ckpt_dir = ckpt_dir
        ranks: dict[tuple[int, int], str] = {}
        has_pp = False
        for d in sorted(os.listdir(ckpt_dir)):
            m = _RANK_DIR.match(d)
            if not m:
                continue
            if m.group(3) is not None:
                raise ValueError(f"{ckpt_dir}/{d}: expert-parallel legacy checkpoints are not supported")
            has_pp |= m.group(2) is not None
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(ckpt_dir, d, LEGACY_FILE)
        if not ranks:
            raise FileNotFoundError(f"No mp_rank_* directories in {ckpt_dir}")
        self.tp = max(t for t, _ in ranks) + 1
        self.pp = max(p for _, p in ranks) + 1
        missing = [
            f"mp_rank_{t:02d}" + (f"_{p:03d}" if has_pp else "")
            for t in range(self.tp)
            for p in range(self.pp)
            if not os.path.isfile(ranks.get((t, p), ""))
        ]
        if missing:
            raise FileNotFoundError(
                f"{ckpt_dir}: incomplete legacy checkpoint, missing {missing} ({LEGACY_FILE})"
            )
        self._files = ranks
        self._loaded: dict[tuple[int, int], dict] = {}
        self._models: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def file(self, tp_rank: int, pp_rank: int) -> str:
        return self._files[(tp_rank, pp_rank)]

    def raw(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._loaded:
            obj = safe_torch_load(self.file(*key), mmap=True)
            if not isinstance(obj, dict):
                raise ValueError(f"{self.file(*key)}: expected a dict, found {type(obj).__name__}")
            self._loaded[key] = obj
        return self._loaded[key]

    def model(self, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
        """Weights of one file under local-spec names (local layer indices)."""
        key = (tp_rank, pp_rank)
        if key not in self._models:
            raw, file = self.raw(*key), self.file(*key)
            if "model" not in raw:
                chunks = sorted(k for k in raw if re.match(r"^model\d+$", k))
                if chunks:
                    raise ValueError(f"{file}: virtual-pipeline checkpoints ({chunks}) are not supported")
                raise ValueError(f"{file}: no 'model' entry (keys: {sorted(raw)})")
            out = {}
            for name, value in _flatten(raw["model"]):
                local = _normalize_legacy_name(name, file)
                if local is not None and isinstance(value, torch.Tensor):
                    out[local] = value
            self._models[key] = out
        return self._models[key]

    @property
    def args(self) -> argparse.Namespace | None:
        ns = self.raw(0, 0).get("args")
        return ns if isinstance(ns, argparse.Namespace) else None

    def layers_per_stage(self) -> list[int]:
        """Transformer layers held by each pipeline stage (Megatron-LM allows uneven stages)."""
        counts = []
        for p in range(self.pp):
            idx = {layer_index(n) for n in self.model(0, p)} - {None}
            if idx and idx != set(range(len(idx))):
                raise ValueError(f"{self.file(0, p)}: layer indices {sorted(idx)} are not local (0..n-1)")
            counts.append(len(idx))
        return counts


class _LayerCachedReader:
    """``HFReader``'s interface over a Megatron checkpoint: HF tensors are produced one read unit (a
    layer, or a non-layer tensor) at a time and cached until a tensor of another unit is asked for.

    Subclasses fill ``_producer`` (HF name -> the Megatron layout that produces it) and define
    ``_group_of`` (the read unit of a layout) and ``_produce`` (HF tensors of that unit).
    """

    args: ModelArgs
    path: str

    def _init_cache(self) -> None:
        self._producer: dict[str, ParamLayout] = {}
        self._cache: dict[str, torch.Tensor] = {}
        self._cache_group: object = "empty"
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._producer)

    def get(self, name: str) -> torch.Tensor:
        lay = self._producer.get(name)
        if lay is None:
            raise KeyError(f"Tensor {name!r} is not part of the {self.args.arch} model in {self.path}")
        group = self._group_of(lay)
        if group != self._cache_group:
            self._cache, self._cache_group = {}, group
        if name not in self._cache:
            self._cache.update(self._produce(lay, group))
        return self._cache[name]

    def read(self, piece: Piece, dim: int | None) -> torch.Tensor:
        full = self.get(piece.hf_name)
        return full[:, piece.start : piece.stop] if dim == 1 else full[piece.start : piece.stop]

    def _group_of(self, lay: ParamLayout) -> object:
        raise NotImplementedError

    def _produce(self, lay: ParamLayout, group: object) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class LegacyReader(_LayerCachedReader):
    """HF tensors from a legacy checkpoint, with ``HFReader``'s interface.

    Each requested HF tensor is produced by merging the TP shards of the Megatron parameter that
    holds it (``scatter_shard`` with the checkpoint's TP layout); the tensors of the current layer
    are cached, so a layer-ordered consumer keeps about one layer in memory.
    """

    def __init__(self, ckpt: LegacyCheckpoint, args: ModelArgs) -> None:
        self.ckpt, self.args, self.path = ckpt, args, ckpt.ckpt_dir
        self.shapes = hf_shapes(args)
        self.offsets = _stage_offsets(ckpt.layers_per_stage())
        if self.offsets[-1] != args.num_layers:
            raise ValueError(
                f"{ckpt.ckpt_dir}: the stages hold {self.offsets[-1]} layers, the model config says "
                f"{args.num_layers}; the config does not belong to this checkpoint"
            )
        self._init_cache()
        expected: dict[int, set[str]] = {p: set() for p in range(ckpt.pp)}
        for lay in param_layouts(args, ckpt.tp):
            stage, local = self._where(lay.name)
            if lay.name == "output_layer.weight" and args.tie_embeddings and ckpt.pp == 1:
                continue  # tied, single stage: the embedding is the head
            expected[stage].add(local)
            for n in hf_names(lay):
                self._producer.setdefault(n, lay)
        for p, names in expected.items():
            for t in range(ckpt.tp):
                found = set(ckpt.model(t, p))
                if found != names:
                    raise ValueError(
                        f"{ckpt.file(t, p)} does not match a {args.arch} model with "
                        f"{args.num_layers} layers: "
                        f"missing {sorted(names - found)[:8]}, unexpected {sorted(found - names)[:8]}"
                    )

    def _where(self, name: str) -> tuple[int, str]:
        i = layer_index(name)
        if i is None:
            return (0 if name.startswith("embedding.") else self.ckpt.pp - 1), name
        stage = next(s for s in range(self.ckpt.pp) if i < self.offsets[s + 1])
        return stage, local_layer_name(name, self.offsets[stage])

    def _group_of(self, lay: ParamLayout) -> object:
        return layer_index(lay.name)

    def _produce(self, lay: ParamLayout, group: object) -> dict[str, torch.Tensor]:
        """Merge the TP shards of one parameter into its HF tensors."""
        stage, local = self._where(lay.name)
        shards = [self.ckpt.model(t, stage)[local] for t in range(self.ckpt.tp)]
        if lay.name in VOCAB_PARAMS:
            lay = fit_vocab(lay, shards[0].shape[0], self.args.vocab_size)
        out = {n: torch.zeros(self.shapes[n], dtype=shards[0].dtype) for n in hf_names(lay)}
        for t, shard in enumerate(shards):
            want = shard_shape(lay, self.shapes)
            if tuple(shard.shape) != want:
                raise ValueError(
                    f"{self.ckpt.file(t, stage)}: {local} has shape {tuple(shard.shape)}, expected {want}"
                )
            scatter_shard(lay, t, shard, out)
            self.bytes_read += shard.numel() * shard.element_size()
        return out


def save_legacy(
    reader: TensorSource,
    args: ModelArgs,
    out: str,
    tp: int,
    pp: int,
    iteration: int = 1,
    dtype: torch.dtype = torch.float32,
    vocab_divisible_by: int = 128,
    with_args: bool = True,
    progress: bool = False,
) -> None:
    """Write a Megatron-LM ``torch``-format checkpoint (what ``--ckpt-format torch`` saves).

    ``reader`` is any HF-tensor reader (``HFReader``, :class:`LegacyReader`, :class:`TorchDistReader`).
    One file per (TP rank, PP stage) with local layer indices, the vocabulary padded to a multiple of
    ``vocab_divisible_by * tp`` as Megatron-LM does, the model-describing args Namespace (unless
    ``with_args`` is False), the iteration and an RNG state. Memory: one file's shard at a time.
    """
    from tqdm import tqdm

    if args.num_layers % pp:
        raise ValueError(f"{args.num_layers} layers do not split into {pp} pipeline stages")
    import numpy as np

    per_stage = args.num_layers // pp
    mult = vocab_divisible_by * tp
    padded = -(-args.vocab_size // mult) * mult
    shapes = hf_shapes(args)
    it_dir = os.path.join(out, f"iter_{iteration:07d}")
    bar = tqdm(total=tp * pp, desc="legacy shards", disable=None if progress else True)
    for p in range(pp):
        for t in range(tp):
            sd: dict[str, torch.Tensor] = {}
            for lay in iter_stage_layouts(args, tp, pp, p):
                if lay.name in VOCAB_PARAMS:
                    lay = fit_vocab(lay, padded // tp, args.vocab_size)
                like = torch.empty(shard_shape(lay, shapes), dtype=dtype)
                sd[local_layer_name(lay.name, p * per_stage)] = assemble_shard(lay, t, reader.read, like)
            state: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": iteration, "model": sd}
            if with_args:
                state["args"] = megatron_args_from_model_args(args, tp, pp, padded, dtype, iteration)
            # As Megatron-LM saves it: python, numpy and torch RNG states (needs the numpy allowlist).
            state["rng_state"] = [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "cuda_rng_state": None,
                    "rng_tracker_states": {},
                }
            ]
            rank_dir = os.path.join(it_dir, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir, exist_ok=True)
            torch.save(state, os.path.join(rank_dir, LEGACY_FILE))
            bar.update()
    bar.close()
    with open(os.path.join(out, TRACKER_FILE), "w") as f:
        f.write(str(iteration))


# --------------------------------------------------------------------------------------------------
# torch_dist (megatron.core.dist_checkpointing)
# --------------------------------------------------------------------------------------------------


def torch_dist_key(name: str) -> tuple[str, int | None]:
    """Global Megatron parameter name -> (dist_checkpointing key, layer index on the stacked axis)."""
    i = layer_index(name)
    if i is None:
        return name, None
    rest = name.split(".", 3)[3]
    return "decoder.layers." + TE_NORM_NAMES.get(rest, rest), i


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def save_torch_dist(model: torch.nn.Module, ps: ParallelState, path: str, extra: dict | None = None) -> None:
    """Save this rank's shard of ``model`` into the torch_dist checkpoint directory ``path``.

    Collective: every rank of the job calls it (data-parallel replicas are deduplicated by
    megatron-core). Everything is written inside ``path`` (created if missing), so a caller can save
    into a temporary directory and rename it. ``megatron_rl.json`` (the HF config, role, layout) is
    written last, by rank 0, after every rank has finished.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if ps.rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sharded = model.sharded_state_dict()
    dist_checkpointing.save({"model": sharded}, path)
    dist.barrier()
    if ps.rank == 0:
        dtype = next(model.parameters()).dtype
        meta = {
            "format": "megatron-rl torch_dist",
            "version": 1,
            "role": model.role,
            "arch": model.args.arch,
            "tp": ps.tp_size,
            "pp": ps.pp_size,
            "dtype": str(dtype).replace("torch.", ""),
            "hf_config": model.args.hf_config,
            **(extra or {}),
        }
        _write_json_atomic(os.path.join(path, METADATA_FILE), meta)
    dist.barrier()


def _resolve_torch_dist(path: str) -> CheckpointLocation:
    loc = locate_megatron_checkpoint(path)
    if loc is None or loc.format != "torch_dist":
        raise FileNotFoundError(
            f"{path} is not a torch_dist checkpoint (no metadata.json with sharded_backend, and no "
            f"{TRACKER_FILE} pointing to one)"
        )
    return loc


@torch.no_grad()
def load_torch_dist(model: torch.nn.Module, ps: ParallelState, path: str) -> None:
    """Fill ``model`` (any TP/PP) from a torch_dist checkpoint saved at any TP/PP. Collective.

    A critic loading an actor's checkpoint takes the trunk and keeps its value head; an actor cannot
    load a critic's checkpoint (no LM head there).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    loc = _resolve_torch_dist(path)
    meta, _ = check_torch_dist(loc.ckpt_dir)
    saved_role = (read_our_metadata(loc) or {}).get("role", "actor")
    if model.role == "actor" and saved_role == "critic":
        raise ValueError(f"{path} is a critic checkpoint (value head, no LM head); an actor cannot load it")
    skip_head = model.role == "critic" and saved_role != "critic"
    sharded = {}
    for name, sh in model.sharded_state_dict().items():
        if isinstance(sh, ShardedObject) or name.endswith("_extra_state"):
            continue  # pickled extras (empty for the local spec); DCP would unpickle them unchecked
        if skip_head and name.startswith("output_layer."):
            continue
        if not isinstance(sh, ShardedTensor | ShardedTensorFactory):
            raise TypeError(f"unexpected {type(sh).__name__} for {name} in the model's sharded_state_dict")
        md = meta.state_dict_metadata.get(sh.key)
        if not isinstance(md, TensorStorageMetadata):
            have = sorted(
                k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
            )
            raise KeyError(f"{loc.ckpt_dir} has no tensor {sh.key!r} (for {name}); it holds {have}")
        sharded[name] = sh
    with torch.serialization.safe_globals(safe_globals()):
        loaded = dist_checkpointing.load({"model": sharded}, loc.ckpt_dir)["model"]
    missing, _ = model.load_state_dict(loaded, strict=False)
    missing = [
        k
        for k in missing
        if not k.endswith("_extra_state") and not (skip_head and k.startswith("output_layer."))
    ]
    if missing:
        raise KeyError(f"{path}: parameters not loaded: {missing}")


class TorchDistReader(_LayerCachedReader):
    """HF tensors from a torch_dist checkpoint, one layer at a time, with ``HFReader``'s interface.

    Each layer's global tensors are read with ``dist_checkpointing.load`` on hand-built ShardedTensors
    (one slice of the stacked layer axis) and split into HF tensors with the TP=1 layout. Needs
    torch.distributed initialised (a world of one is enough); with more ranks, every rank must read
    the same tensors in the same order.
    """

    def __init__(self, path: str, args: ModelArgs) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not dist.is_initialized():
            raise RuntimeError("TorchDistReader needs torch.distributed (init_parallel(1, 1) in one process)")
        self.loc = _resolve_torch_dist(path)
        self.path, self.args = self.loc.ckpt_dir, args
        meta, _ = check_torch_dist(self.loc.ckpt_dir)
        self.tensors = {
            k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
        ours = read_our_metadata(self.loc) or {}
        if ours.get("role") == "critic":
            raise ValueError(f"{path} is a critic checkpoint: it has a value head, not an LM head to export")
        self.shapes = hf_shapes(args)
        # Read units: all tensors of one layer together; the embedding, final norm and head one by one.
        self._groups: dict[int | str, list[ParamLayout]] = {}
        self._init_cache()
        for lay in param_layouts(args, 1):
            key, i = torch_dist_key(lay.name)
            if lay.name == "output_layer.weight" and args.tie_embeddings:
                continue  # tied: stored once, as the embedding
            if key not in self.tensors:
                raise KeyError(
                    f"{self.path} has no tensor {key!r} (for {lay.name}); it holds {sorted(self.tensors)}"
                )
            self._groups.setdefault(lay.name if i is None else i, []).append(lay)
            for n in hf_names(lay):
                self._producer.setdefault(n, lay)

    def _group_of(self, lay: ParamLayout) -> object:
        i = torch_dist_key(lay.name)[1]
        return lay.name if i is None else i

    def _produce(self, lay: ParamLayout, group: object) -> dict[str, torch.Tensor]:
        """Read every tensor of the unit ``group`` (one layer, or one non-layer tensor) at once."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sharded = {}
        for lay in self._groups[group]:
            key, i = torch_dist_key(lay.name)
            md = self.tensors[key]
            size, dtype = tuple(md.size), md.properties.dtype
            # The whole tensor, or the slice [i:i+1] of the [num_layers, ...] stack. No fragmentation
            # grid: this process reads a part that no rank of the saving job held on its own.
            local = size if i is None else (1, *size[1:])
            offset = (0,) * len(size) if i is None else (i,) + (0,) * (len(size) - 1)
            sharded[lay.name] = ShardedTensor(
                key, torch.empty(local, dtype=dtype), dtype, local, size, offset, axis_fragmentations=None
            )
        with torch.serialization.safe_globals(safe_globals()):
            # Only one layer's slices are read, so the "whole tensor covered" check does not apply.
            loaded = dist_checkpointing.load(sharded, self.loc.ckpt_dir, validate_access_integrity=False)
        out: dict[str, torch.Tensor] = {}
        for lay in self._groups[group]:
            t = loaded[lay.name] if torch_dist_key(lay.name)[1] is None else loaded[lay.name][0]
            self.bytes_read += t.numel() * t.element_size()
            if lay.name in VOCAB_PARAMS:
                lay = fit_vocab(lay, t.shape[0], self.args.vocab_size)
            elif tuple(t.shape) != shard_shape(lay, self.shapes):
                raise ValueError(
                    f"{self.path}: {lay.name} has shape {tuple(t.shape)}, the model config implies "
                    f"{shard_shape(lay, self.shapes)}; the config does not belong to this checkpoint"
                )
            for n in hf_names(lay):
                out.setdefault(n, torch.zeros(self.shapes[n], dtype=t.dtype))
            scatter_shard(lay, 0, t, out)
        return out
