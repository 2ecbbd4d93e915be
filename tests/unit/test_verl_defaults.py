"""The defaults of the keys this config shares with verl's Megatron PPO trainer config
(``megatron_rl/verl_defaults.json``): each is verl's, or a deliberate difference listed with its reason
in ``verl_rules.DEFAULT_DIFFERENCES`` (and every listed difference really differs)."""

from __future__ import annotations

import dataclasses
import re

import pytest

import yaml
from megatron_rl.config import Config, known_keys, load_config
from megatron_rl.config.layout import expert_layout
from megatron_rl.dotted import leaves
from megatron_rl.verl_compat import project_key, verl_defaults
from megatron_rl.verl_rules import DEFAULT_DIFFERENCES

KNOWN = set(known_keys(Config))
RAW = dict(leaves(dataclasses.asdict(Config())))
INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([^,}]+)(?:,(.*))?\}$")

# A value of each key that verl's defaults follow, unlike its default (to see whether this config
# follows it too).
PROBES = {
    "actor_rollout_ref.actor.use_dynamic_bsz": "true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "4096",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "64",
    "actor_rollout_ref.actor.ppo_epochs": "2",
    "actor_rollout_ref.actor.shuffle": "true",
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
    "actor_rollout_ref.actor.megatron.param_offload": "true",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "2",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "2",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": "2",
    "actor_rollout_ref.actor.megatron.override_transformer_config": "{moe_aux_loss_coeff: 0.01}",
    "actor_rollout_ref.actor.megatron.use_remove_padding": "false",
    "actor_rollout_ref.model.path": "/probe/model",
    "critic.ppo_max_token_len_per_gpu": "4096",
}


def _resolved(cfg: Config, key: str):
    """``key``'s value in a loaded config; the expert layout as the models resolve it."""
    section, _, leaf = key.rpartition(".")
    if leaf in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        obj, actor = cfg, cfg.actor_rollout_ref.actor.megatron
        for p in section.split("."):
            obj = getattr(obj, p)
        ep, etp = expert_layout(obj, actor)
        return ep if leaf == "expert_model_parallel_size" else etp
    obj = cfg
    for p in key.split("."):
        obj = getattr(obj, p)
    return obj


def _source(verl_key: str, value) -> tuple[str, object] | None:
    """(the key verl's default follows, its fallback) when ``value`` is an interpolation of one key."""
    m = INTERPOLATION.match(value) if isinstance(value, str) else None
    if m is None:
        return None
    src = m.group(1)
    if src.startswith("."):  # relative: a sibling of the key
        src = verl_key.rpartition(".")[0] + src
    return src, yaml.safe_load(m.group(2)) if m.group(2) is not None else None


def _differs(verl_key: str, key: str, value) -> bool:
    follows = _source(verl_key, value)
    if follows is None:
        return RAW[key] != value
    src, fallback = follows
    src = project_key(src, KNOWN)
    if src is None:  # verl's default follows a key this config has not: its fallback
        return RAW[key] != fallback
    assert src in PROBES, f"add a probe value of {src}"
    cfg = load_config(None, [f"{src}={PROBES[src]}"])
    return _resolved(cfg, key) != _resolved(cfg, src)


SHARED = {project_key(k, KNOWN): (k, v) for k, v in verl_defaults().items()}


def test_the_table_names_keys_of_both_configs():
    assert verl_defaults(), "megatron_rl/verl_defaults.json holds no key"
    assert None not in SHARED, "verl_defaults.json holds a key this config does not have"
    assert len(SHARED) == len(verl_defaults())


@pytest.mark.parametrize("key", sorted(SHARED))
def test_default_is_verls_or_a_listed_difference(key):
    verl_key, value = SHARED[key]
    differs = _differs(verl_key, key, value)
    if key in DEFAULT_DIFFERENCES:
        assert differs, f"{key}: listed in DEFAULT_DIFFERENCES but its default is verl's ({value!r}): drop it"
        assert DEFAULT_DIFFERENCES[key].why.strip(), f"{key}: a difference needs its reason"
        assert DEFAULT_DIFFERENCES[key].here == RAW[key], f"{key}: DEFAULT_DIFFERENCES states another default"
    else:
        assert not differs, (
            f"{key}: default {RAW[key]!r}, verl's {value!r}: take verl's or list it in "
            "verl_rules.DEFAULT_DIFFERENCES with the reason"
        )


def test_every_listed_difference_is_a_shared_key():
    assert set(DEFAULT_DIFFERENCES) <= set(SHARED)
