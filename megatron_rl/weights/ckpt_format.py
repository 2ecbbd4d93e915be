"""Megatron checkpoints on disk: file names, and which format (torch_dist or legacy) a path holds.

:func:`locate_megatron_checkpoint` resolves a path the user names (a torch_dist directory, an iteration
directory of legacy ``mp_rank_*`` shards, or a Megatron-LM save directory with its tracker file) to a
:class:`CheckpointLocation`; :func:`read_our_metadata` reads the ``megatron_rl.json`` we write beside
our torch_dist checkpoints (the HF config, the role, the layout it was saved at).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

METADATA_FILE = "megatron_rl.json"
"""Written beside our torch_dist checkpoints: {"hf_config", "role", "tp", "pp", "dtype", ...}."""
TRACKER_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"

# Megatron-LM checkpoints made with Transformer Engine fuse the pre-attention / pre-MLP norms into
# the next linear layer; megatron-core's sharded_state_dict uses those names for the local spec too.
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def norm_key_alias(key: str) -> str | None:
    """The other name of a layer norm's checkpoint key (fused <-> separate), None for other keys.

    A mixture-of-experts layer's pre-MLP norm is saved under the fused name by megatron-core's local
    spec and under its own by Transformer Engine's (where no linear follows it): a checkpoint saved on
    one implementation holds the name the other asks for."""
    for sep, fused in TE_NORM_NAMES.items():
        for have, other in ((sep, fused), (fused, sep)):
            if key.endswith("." + have):
                return key[: -len(have)] + other
    return None


@dataclass(frozen=True)
class CheckpointLocation:
    format: str
    """"torch_dist" or "legacy"."""
    root: str
    """The directory the user named."""
    ckpt_dir: str
    """The dist_checkpointing directory, or the iteration directory holding ``mp_rank_*``."""
    iteration: int | None


RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
"""A legacy shard's directory: mp_rank_TT, mp_rank_TT_PPP, or mp_rank_TT_PPP_EEE (expert parallel)."""


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
    return os.path.isdir(d) and any(RANK_DIR.match(x) for x in os.listdir(d))


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


def resolve_torch_dist(path: str) -> CheckpointLocation:
    loc = locate_megatron_checkpoint(path)
    if loc is None or loc.format != "torch_dist":
        raise FileNotFoundError(
            f"{path} is not a torch_dist checkpoint (no metadata.json with sharded_backend, and no "
            f"{TRACKER_FILE} pointing to one)"
        )
    return loc
