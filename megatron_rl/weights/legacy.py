"""Reading legacy Megatron-LM ``torch``-format checkpoints.

Layout: ``latest_checkpointed_iteration.txt``, ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``;
every file is one TP shard of one pipeline stage with LOCAL layer indices. :class:`LegacyReader`
merges the TP shards of one parameter into full HF tensors with ``scatter_shard`` (a legacy shard of
``linear_qkv`` / ``linear_fc1`` has exactly the layout that ``param_layouts`` gives for its TP rank),
keeping about one layer in memory. Files are vetted by :func:`~megatron_rl.weights.safe_load.safe_torch_load`.
Writing is :func:`megatron_rl.weights.ckpt_write.save_legacy`.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from megatron_rl.errors import ModelRefused
from megatron_rl.model_args import ModelArgs
from megatron_rl.weights.ckpt_format import LEGACY_FILE, RANK_DIR, TE_NORM_NAMES
from megatron_rl.weights.hf_io import hf_names, scatter_shard
from megatron_rl.weights.layer_cache import LayerCachedReader
from megatron_rl.weights.safe_load import safe_torch_load
from megatron_rl.weights.shards import VOCAB_PARAMS, fit_vocab, shard_shape, stage_offsets
from megatron_rl.weights.tables import ParamLayout, hf_shapes, layer_index, local_layer_name, param_layouts

MOE_LEGACY = (
    "legacy Megatron-LM checkpoints of mixture-of-experts models (per-EP-rank mp_rank_*_*_* files) are "
    "not supported: convert through torch_dist (ckpt_tools hf-to-mcore --ep N / mcore-to-hf)"
)


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
        raise ModelRefused(
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
            m = RANK_DIR.match(d)
            if not m:
                continue
            if m.group(3) is not None:
                raise ModelRefused(f"{ckpt_dir}/{d}: expert-parallel legacy checkpoints are not supported")
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
                raise ModelRefused(f"{self.file(*key)}: expected a dict, found {type(obj).__name__}")
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
                    raise ModelRefused(f"{file}: virtual-pipeline checkpoints ({chunks}) are not supported")
                raise ModelRefused(f"{file}: no 'model' entry (keys: {sorted(raw)})")
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
                raise ModelRefused(f"{self.file(0, p)}: layer indices {sorted(idx)} are not local (0..n-1)")
            counts.append(len(idx))
        return counts


class LegacyReader(LayerCachedReader):
    """HF tensors from a legacy checkpoint, with ``HFReader``'s interface.

    Each requested HF tensor is produced by merging the TP shards of the Megatron parameter that
    holds it (``scatter_shard`` with the checkpoint's TP layout); the tensors of the current layer
    are cached, so a layer-ordered consumer keeps about one layer in memory.
    """

    def __init__(self, ckpt: LegacyCheckpoint, args: ModelArgs) -> None:
        if args.is_moe:
            raise ModelRefused(MOE_LEGACY)
        self.ckpt, self.args, self.path = ckpt, args, ckpt.ckpt_dir
        self.shapes = hf_shapes(args)
        self.offsets = stage_offsets(ckpt.layers_per_stage())
        if self.offsets[-1] != args.num_layers:
            raise ModelRefused(
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
                    raise ModelRefused(
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
                raise ModelRefused(
                    f"{self.ckpt.file(t, stage)}: {local} has shape {tuple(shard.shape)}, expected {want}"
                )
            scatter_shard(lay, t, shard, out)
            self.bytes_read += shard.numel() * shard.element_size()
        return out
