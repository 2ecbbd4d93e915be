"""Writing an HF model directory from a stream of HF tensors, one tensor at a time.

``reader`` is any HF-tensor reader (``HFReader``, ``LegacyReader``, ``TorchDistReader``); tensors are
requested in model order (embedding, layer 0, 1, ..., final norm, head), so a layer-caching reader
holds one layer. Written tensors are buffered until ``max_shard_bytes`` and flushed to a safetensors
file; peak memory is about one shard plus one layer. The config.json is the model's original HF
config (``ModelArgs.hf_config``), so transformers' ``from_pretrained`` loads the result.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron_rl.model_args import ModelArgs
from megatron_rl.weights.shards import TensorSource
from megatron_rl.weights.tables import hf_shapes


def parse_size(text: str) -> int:
    """'2GB', '500MB', '123' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*", text.upper())
    if not m:
        raise ValueError(f"Cannot parse size {text!r} (examples: 2GB, 500MB)")
    unit = (m.group(2) or "B").rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def write_hf(
    reader: TensorSource,
    args: ModelArgs,
    out: str,
    max_shard_bytes: int = 1 << 30,
    progress: bool = True,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write config.json and safetensors shards (with an index when there are several) to ``out``.

    ``dtype``: cast every tensor to it (megatron keeps norm weights in float32 in bf16 models).
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    os.makedirs(out, exist_ok=True)
    shapes = hf_shapes(args)
    names = list(shapes)
    files: list[list[str]] = []
    buf: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal buf, size
        if buf:
            save_file(buf, os.path.join(out, f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
            files.append(list(buf))
            buf, size = {}, 0

    for name in tqdm(names, desc="writing HF tensors", disable=None if progress else True):
        t = reader.get(name).contiguous()
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, the config implies {shapes[name]}")
        # a copy: detached from the reader's cache and from any memory-mapped file
        buf[name] = t.clone() if dtype is None or t.dtype == dtype else t.to(dtype)
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if size >= max_shard_bytes:
            flush()
    flush()
    n = len(files)
    final = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for i, fname in enumerate(final):
        os.replace(os.path.join(out, f"part-{i:05d}.safetensors"), os.path.join(out, fname))
    if n > 1:
        weight_map = {name: fname for fname, names_ in zip(final, files, strict=True) for name in names_}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = dict(args.hf_config)
    if dtype is not None:  # the config says what the files hold
        name = str(dtype).replace("torch.", "")
        for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
            config[key] = name
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return final
