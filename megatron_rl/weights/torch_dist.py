"""Reading megatron-core ``torch_dist`` checkpoints (megatron.core.dist_checkpointing).

The files hold global tensors (layers stacked on a leading axis, fused layouts already
TP-independent), so a checkpoint saved at one TP x PP loads at any other: :func:`load_torch_dist`
fills a model through its own ``sharded_state_dict()``; :class:`TorchDistReader` reads the same files
one layer at a time, without a model, and presents them as HF tensors (for ``mcore-to-hf``). Every
pickle is vetted first (:mod:`megatron_rl.weights.safe_load`). Writing is
:func:`megatron_rl.weights.ckpt_write.save_torch_dist`.
"""

from __future__ import annotations

import re
from collections.abc import Container

import torch

from megatron_rl.model_args import ModelArgs
from megatron_rl.parallel import ParallelState
from megatron_rl.weights.ckpt_format import (
    TE_NORM_NAMES,
    norm_key_alias,
    read_our_metadata,
    resolve_torch_dist,
)
from megatron_rl.weights.hf_io import hf_names, scatter_shard
from megatron_rl.weights.layer_cache import LayerCachedReader
from megatron_rl.weights.safe_load import check_torch_dist, safe_globals
from megatron_rl.weights.shards import VOCAB_PARAMS, fit_vocab, shard_shape
from megatron_rl.weights.tables import ParamLayout, hf_shapes, layer_index, param_layouts

_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_CHUNK = re.compile(r"^chunks\.\d+\.")  # a model chunk's prefix (interleaved pipelines: ModelChunks)


def torch_dist_key(
    name: str, per_layer: bool = False, keys: Container[str] | None = None
) -> tuple[str, int | None]:
    """Global Megatron parameter name -> (dist_checkpointing key, index on the key's first axis).

    Dense models stack the layers: ``decoder.layers.<rest>`` [num_layers, ...], indexed by layer.
    Mixture-of-experts models (``per_layer``: megatron saves a per-layer MoE pattern layer by layer)
    have ``decoder.layers.{i}.<rest>``, and each layer's experts stacked as
    ``decoder.layers.{i}.mlp.experts.experts.<linear>`` [num_experts, ...], indexed by expert.
    Norms are saved under Transformer Engine's fused names where the layer has the fused linear
    (``linear_qkv``, ``linear_fc1``); multi-latent attention and MoE layers keep theirs: with ``keys``
    (the checkpoint's) the name it holds is taken.
    """
    i = layer_index(name)
    if i is None:
        return name, None
    rest = name.split(".", 3)[3]
    prefix = "decoder.layers." if not per_layer else f"decoder.layers.{i}."
    if per_layer and (m := _EXPERT.search(name)):
        return f"decoder.layers.{i}.mlp.experts.experts.{name[m.end() :]}", int(m.group(1))
    key = prefix + TE_NORM_NAMES.get(rest, rest)
    if keys is not None and key not in keys:
        key = prefix + rest
    return key, None if per_layer else i


@torch.no_grad()
def load_torch_dist(model: torch.nn.Module, ps: ParallelState, path: str) -> None:
    """Fill ``model`` (any TP/PP) from a torch_dist checkpoint saved at any TP/PP. Collective.

    A critic loading an actor's checkpoint takes the trunk and keeps its value head; an actor cannot
    load a critic's checkpoint (no LM head there).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    loc = resolve_torch_dist(path)
    meta, _ = check_torch_dist(loc.ckpt_dir)
    saved_role = (read_our_metadata(loc) or {}).get("role", "actor")
    if model.role == "actor" and saved_role == "critic":
        raise ValueError(f"{path} is a critic checkpoint (value head, no LM head); an actor cannot load it")
    skip_head = model.role == "critic" and saved_role != "critic"
    wanted = _lora_wanted(model, read_our_metadata(loc) or {}, path)
    sharded = {}
    for name, sh in model.sharded_state_dict().items():
        if isinstance(sh, ShardedObject) or name.endswith("_extra_state"):
            continue  # pickled extras (empty for the local spec); DCP would unpickle them unchecked
        if wanted is not None and name not in wanted:
            continue  # the base of a LoRA model: loaded from its own path
        if skip_head and _CHUNK.sub("", name).startswith("output_layer."):
            continue
        if not isinstance(sh, ShardedTensor | ShardedTensorFactory):
            raise TypeError(f"unexpected {type(sh).__name__} for {name} in the model's sharded_state_dict")
        md = meta.state_dict_metadata.get(sh.key)
        alias = norm_key_alias(sh.key)  # a norm saved by the other layer implementation
        if not isinstance(md, TensorStorageMetadata) and alias in meta.state_dict_metadata:
            sh.key, md = alias, meta.state_dict_metadata[alias]
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
        if not k.endswith("_extra_state")
        and not (skip_head and _CHUNK.sub("", k).startswith("output_layer."))
        and (wanted is None or k in wanted)
    ]
    if missing:
        raise KeyError(f"{path}: parameters not loaded: {missing}")


def _lora_wanted(model: torch.nn.Module, meta: dict, path: str) -> set[str] | None:
    """The parameters a LoRA model takes from a checkpoint of its adapters (None: a model without
    adapters takes everything); the checkpoint must be one of adapters of the same shape and base."""
    import os

    lora, saved = getattr(model, "lora", None), meta.get("lora")
    if lora is None and saved is None:
        return None
    if lora is None:
        assert saved is not None
        raise ValueError(
            f"{path} holds LoRA adapters (rank {saved['rank']}) of {saved['base']}: load them into a model "
            f"with *.model.lora.rank={saved['rank']} and model.path={saved['base']}."
        )
    if saved is None:
        raise ValueError(
            f"{path} holds a whole model, not LoRA adapters: point model.path at it with "
            "*.model.lora.rank=0, or resume from a checkpoint written with LoRA on."
        )
    if (saved["rank"], tuple(saved["targets"])) != (lora.rank, lora.targets):
        raise ValueError(
            f"{path} holds LoRA adapters of rank {saved['rank']} on {saved['targets']}; this model's are "
            f"rank {lora.rank} on {list(lora.targets)}: set *.model.lora.rank / target_modules to the "
            "checkpoint's."
        )
    if os.path.realpath(saved["base"]) != os.path.realpath(lora.base):
        raise ValueError(
            f"{path} holds LoRA adapters trained on {saved['base']}, this model's base is {lora.base}: "
            f"set model.path={saved['base']}."
        )
    return {n for n, p in model.named_parameters() if p.requires_grad}


class TorchDistReader(LayerCachedReader):
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
        self.loc = resolve_torch_dist(path)
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
        self.per_layer = args.is_moe
        for lay in param_layouts(args, 1):
            key, i = torch_dist_key(lay.name, self.per_layer, self.tensors)
            if lay.name == "output_layer.weight" and args.tie_embeddings:
                continue  # tied: stored once, as the embedding
            if key not in self.tensors:
                raise KeyError(
                    f"{self.path} has no tensor {key!r} (for {lay.name}); it holds {sorted(self.tensors)}"
                )
            self._groups.setdefault(self._group_of(lay), []).append(lay)
            for n in hf_names(lay):
                self._producer.setdefault(n, lay)

    def _group_of(self, lay: ParamLayout) -> object:
        i = layer_index(lay.name)
        return lay.name if i is None else i

    def _produce(self, lay: ParamLayout, group: object) -> dict[str, torch.Tensor]:
        """Read every tensor of the unit ``group`` (one layer, or one non-layer tensor) at once."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sharded = {}
        for lay in self._groups[group]:
            key, i = torch_dist_key(lay.name, self.per_layer, self.tensors)
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
            t = (
                loaded[lay.name]
                if torch_dist_key(lay.name, self.per_layer, self.tensors)[1] is None
                else loaded[lay.name][0]
            )
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
