"""Writing Megatron checkpoints: legacy Megatron-LM ``torch`` files and megatron-core ``torch_dist``.

Both take what the readers give: :func:`save_legacy` cuts each TP shard out of any HF-tensor source
(``HFReader``, ``LegacyReader``, ``TorchDistReader``) with ``assemble_shard``; :func:`save_torch_dist`
saves a model through its ``sharded_state_dict()`` and writes ``megatron_rl.json`` beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any

import torch

from megatron_rl.errors import ModelRefused
from megatron_rl.model_args import ModelArgs
from megatron_rl.parallel import ParallelState
from megatron_rl.weights.ckpt_format import LEGACY_FILE, METADATA_FILE, TRACKER_FILE
from megatron_rl.weights.hf_io import assemble_shard
from megatron_rl.weights.megatron_args import megatron_args_from_model_args
from megatron_rl.weights.shards import VOCAB_PARAMS, TensorSource, fit_vocab, shard_shape
from megatron_rl.weights.tables import hf_shapes, iter_stage_layouts, local_layer_name


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
    if args.is_moe:
        from megatron_rl.weights.legacy import MOE_LEGACY

        raise ModelRefused(MOE_LEGACY)
    from tqdm import tqdm

    if args.num_layers % pp:
        raise ModelRefused(f"{args.num_layers} layers do not split into {pp} pipeline stages")
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
    lora = getattr(model, "lora", None)
    if lora is not None:  # the trained parameters only: the base is lora.base's, recorded below
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        sharded = {n: sh for n, sh in sharded.items() if n in trained}
        extra = {**(extra or {}), "lora": dataclasses.asdict(lora)}
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
            "vpp": len(getattr(model, "chunks", ())) or 1,
            "ep": ps.ep_size,
            "dtype": str(dtype).replace("torch.", ""),
            "hf_config": model.args.hf_config,
            **(extra or {}),
        }
        _write_json_atomic(os.path.join(path, METADATA_FILE), meta)
    dist.barrier()
