"""Loading a model from whatever ``model.path`` names: an HF directory, a megatron-core torch_dist
checkpoint or a legacy Megatron-LM checkpoint, at any TP/PP, into a model at the running TP/PP.

The trainer's sequence::

    args = load_model_args_any(path)        # architecture: config.json / our metadata / saved args
    model = build_model(args, ps, role)     # this rank's stage and TP shard
    load_weights(model, path, ps)           # fills it, resharding as needed

Data flow of ``load_weights`` per format:

* hf: each rank reads its own safetensors slices (``builder.load_hf_weights``);
* torch_dist: megatron-core's dist_checkpointing reads the overlap of the saved global tensors with
  this rank's shard (``weights.torch_dist.load_torch_dist``);
* legacy: a :class:`~megatron_rl.weights.legacy.LegacyReader` merges the saved TP shards of
  each parameter into HF tensors (one layer at a time) and ``assemble_shard`` cuts this rank's shard,
  the same path as an HF directory.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_rl.errors import ModelRefused
from megatron_rl.model_args import ModelArgs, load_model_args, model_args_from_hf_config
from megatron_rl.parallel import ParallelState
from megatron_rl.weights.ckpt_format import (
    LEGACY_FILE,
    METADATA_FILE,
    TRACKER_FILE,
    CheckpointLocation,
    locate_megatron_checkpoint,
    read_our_metadata,
)
from megatron_rl.weights.legacy import LegacyCheckpoint, LegacyReader
from megatron_rl.weights.megatron_args import model_args_from_megatron_args
from megatron_rl.weights.safe_load import check_torch_dist
from megatron_rl.weights.shards import TensorSource
from megatron_rl.weights.torch_dist import TorchDistReader, load_torch_dist


def _is_hf_dir(path: str) -> bool:
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return os.path.isfile(os.path.join(path, "model.safetensors.index.json")) or any(
        f.endswith(".safetensors") for f in os.listdir(path)
    )


def detect_format(path: str) -> str:
    """``"hf"``, ``"torch_dist"`` or ``"legacy"``; a clear error listing what was looked for otherwise."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Model path {path!r} is not a directory")
    loc = locate_megatron_checkpoint(path)
    if loc is not None:
        return loc.format
    if _is_hf_dir(path):
        return "hf"
    if os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".bin") for f in os.listdir(path)
    ):
        raise ModelRefused(
            f"{path} is an HF model saved as pickled *.bin files, which megatron-rl does not load (unsafe). "
            "Re-save it with safetensors: AutoModelForCausalLM.from_pretrained(path).save_pretrained(out)."
        )
    raise FileNotFoundError(
        f"Cannot tell the checkpoint format of {path}. Looked for: an HF model "
        "(config.json + *.safetensors); a torch_dist checkpoint (metadata.json with 'sharded_backend'); "
        f"a legacy Megatron-LM checkpoint (mp_rank_*/{LEGACY_FILE} directories); a Megatron-LM save "
        f"directory ({TRACKER_FILE} naming iter_XXXXXXX). Found: {sorted(os.listdir(path))[:20]}"
    )


def _config_candidates(loc: CheckpointLocation) -> list[str]:
    dirs = [loc.ckpt_dir, loc.root, os.path.dirname(os.path.abspath(loc.root))]
    return [os.path.join(d, "config.json") for d in dict.fromkeys(os.path.abspath(d) for d in dirs)]


def load_model_args_any(path: str) -> ModelArgs:
    """The architecture of the model at ``path``, in any of the three formats.

    Megatron checkpoints, in order: the ``megatron_rl.json`` we save beside torch_dist checkpoints;
    an HF ``config.json`` in the checkpoint directory, the named directory or its parent; the ``args``
    Namespace that Megatron-LM saves inside its checkpoints. Otherwise an error says which file to add.
    """
    fmt = detect_format(path)
    if fmt == "hf":
        return load_model_args(path)
    loc = locate_megatron_checkpoint(path)
    ours = read_our_metadata(loc)
    if ours is not None:
        return model_args_from_hf_config(ours["hf_config"])
    configs = _config_candidates(loc)
    for cfg in configs:
        if os.path.isfile(cfg):
            with open(cfg) as f:
                return model_args_from_hf_config(json.load(f))
    if fmt == "legacy":
        ckpt = LegacyCheckpoint(loc.ckpt_dir)
        ns, where = ckpt.args, ckpt.file(0, 0)
    else:
        _, common = check_torch_dist(loc.ckpt_dir)
        ns = common.get("args") if isinstance(common, dict) else None
        where = os.path.join(loc.ckpt_dir, "common.pt")
    if ns is not None:
        return model_args_from_megatron_args(ns, where)
    raise FileNotFoundError(
        f"Cannot determine the architecture of the {fmt} checkpoint at {path}: it has no {METADATA_FILE}, "
        f"no saved Megatron-LM args in {where}, and there is no HF config.json at any of {configs}. "
        f"Add the model's HF config.json to {os.path.abspath(loc.root)} (or its parent directory)."
    )


def open_reader(path: str, args: ModelArgs) -> TensorSource:
    """An ``HFReader``-like view (``read``/``get``/``keys``) of the HF tensors stored at ``path``.

    torch_dist needs torch.distributed initialised (a world of one is enough).
    """
    from megatron_rl.weights.hf_io import HFReader

    fmt = detect_format(path)
    if fmt == "hf":
        return HFReader(path)
    loc = locate_megatron_checkpoint(path)
    if fmt == "legacy":
        return LegacyReader(LegacyCheckpoint(loc.ckpt_dir), args)
    return TorchDistReader(path, args)


def load_weights(model: torch.nn.Module, path: str, ps: ParallelState, progress: bool = False) -> str:
    """Fill an already built model (``builder.build_model``) from ``path``; returns the format found.

    Collective for torch_dist (every rank calls it). A critic loaded from an HF, actor or reward-model
    checkpoint gets the trunk; its value head is left as built. A reward model (``role="reward"``)
    needs a score head: an HF ``...ForSequenceClassification`` with num_labels=1, or a torch_dist
    checkpoint saved from a reward model.
    """
    from megatron_rl.models.builder import fill_from_reader, load_hf_weights

    fmt = detect_format(path)
    if fmt == "torch_dist" and model.role in ("actor", "reward"):
        # Both heads are saved as output_layer.weight ([V, H] vs [1, H]): refuse the mix-up by role.
        saved = (read_our_metadata(locate_megatron_checkpoint(path)) or {}).get("role", "actor")
        if (saved == "reward") != (model.role == "reward"):
            raise ModelRefused(
                f"{path} is a {saved} checkpoint, whose output_layer is not a {model.role} model's head; "
                "a reward model loads a reward model's checkpoint or HF ...ForSequenceClassification "
                "directory, an actor an actor's."
            )
    if fmt == "hf":
        load_hf_weights(model, path, ps)
    elif fmt == "torch_dist":
        load_torch_dist(model, ps, path)
    else:
        loc = locate_megatron_checkpoint(path)
        fill_from_reader(model, ps, LegacyReader(LegacyCheckpoint(loc.ckpt_dir), model.args), progress)
    return fmt
