"""Reading HF safetensors by slices, and moving tensors between Megatron shards and HF tensors."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable

import torch

from megatron_rl.weights.tables import ParamLayout, Piece


class HFReader:
    """Random access to the tensors of an HF model directory, reading only the requested slices.

    ``bytes_read`` counts what was actually materialised, so callers (and tests) can show that a
    rank read its shard and not the model.
    """

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"No *.safetensors files in {path} (HF model directory expected)")
            weight_map = {}
        self._handles = {fn: safe_open(os.path.join(path, fn), framework="pt") for fn in files}
        if not weight_map:
            for fn, h in self._handles.items():
                for k in h.keys():
                    weight_map[k] = fn
        self._where = weight_map
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._where)

    def _handle(self, name: str):
        if name not in self._where:
            raise KeyError(f"Tensor {name!r} not found in {self.path}")
        return self._handles[self._where[name]]

    def read(self, piece: Piece, dim: int | None) -> torch.Tensor:
        """Rows (dim 0 or None) or columns (dim 1) [start, stop) of one HF tensor."""
        sl = self._handle(piece.hf_name).get_slice(piece.hf_name)
        t = sl[:, piece.start : piece.stop] if dim == 1 else sl[piece.start : piece.stop]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def get(self, name: str) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t


def assemble_shard(
    layout: ParamLayout,
    tp_rank: int,
    read: Callable[[Piece, int | None], torch.Tensor],
    like: torch.Tensor,
) -> torch.Tensor:
    """Build TP shard ``tp_rank`` of a Megatron parameter from its HF pieces (padding stays 0).

    ``like`` is the destination parameter (shape and dtype of the shard).
    """
    out = torch.zeros_like(like, device="cpu")
    dim = 0 if layout.dim is None else layout.dim
    pos = 0
    for pc in layout.pieces[tp_rank]:
        block = read(pc, layout.dim)
        n = pc.stop - pc.start
        out.narrow(dim, pos, n).copy_(block)
        pos += n
    if out.shape != like.shape:
        raise ValueError(f"{layout.name}: assembled {tuple(out.shape)}, model has {tuple(like.shape)}")
    return out


def scatter_shard(
    layout: ParamLayout, tp_rank: int, shard: torch.Tensor, out: dict[str, torch.Tensor]
) -> None:
    """Copy TP shard ``tp_rank`` of a Megatron parameter into the full HF tensors in ``out``."""
    dim = 0 if layout.dim is None else layout.dim
    pos = 0
    for pc in layout.pieces[tp_rank]:
        n = pc.stop - pc.start
        out[pc.hf_name].narrow(dim, pc.start, n).copy_(shard.narrow(dim, pos, n))
        pos += n


def hf_names(layout: ParamLayout) -> list[str]:
    """HF tensors a parameter contributes to, in first-seen order."""
    return list(dict.fromkeys(pc.hf_name for rank in layout.pieces for pc in rank))


# Files that travel with a model besides its weights and config.json.
SIDE_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|.*\.model|"
    r"generation_config\.json|chat_template\.(jinja|json))$"
)


def copy_side_files(src_dirs: list[str], out: str) -> list[str]:
    """Copy tokenizer / generation-config files from the first of ``src_dirs`` that has any."""
    for d in src_dirs:
        if not d or not os.path.isdir(d):
            continue
        found = [
            f for f in sorted(os.listdir(d)) if SIDE_FILES.match(f) and os.path.isfile(os.path.join(d, f))
        ]
        if found:
            os.makedirs(out, exist_ok=True)
            for f in found:
                shutil.copy2(os.path.join(d, f), os.path.join(out, f))
            return found
    return []
