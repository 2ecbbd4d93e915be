"""Loading: dataclass defaults <- a YAML file <- dotted command-line overrides, verl's keys translated
(megatron_rl.verl_compat), derived defaults filled from other keys (one source of truth each)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from megatron_rl.config.schema import Config, ConfigError
from megatron_rl.dotted import leaves

# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def known_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> dataclass field type, for every leaf and section."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out[key] = f.type
        ftype = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        sub = ftype() if ftype is not None else None
        if dataclasses.is_dataclass(sub):
            out.update(known_keys(type(sub), key + "."))
    return out


def _check_keys(raw: dict, source: str) -> None:
    known = known_keys(Config)
    # Keys under a dict-typed field (custom_reward_function.reward_kwargs.*) are the user's own.
    free = tuple(k + "." for k, t in known.items() if str(t).startswith("dict"))
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k}
    for key, value in leaves(raw):
        if key in sections and value is not None:
            example = next(k for k in known if k.startswith(key + "."))
            raise ConfigError(
                f"'{key}' (from {source}) is a section of keys, not a value: got {value!r}; write its keys "
                f"under it (e.g. {example}=...)."
            )
        if key not in known and not key.startswith(free):
            near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f" Did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"Unknown config key '{key}' (from {source}).{hint}")


def _lists_from_scalars(raw: dict, prefix: str = "") -> dict:
    """A scalar given for a list-typed key becomes a one-element list (``data.train_files=x.parquet``,
    ``trainer.logger=console``), as verl's command lines write them."""
    known = known_keys(Config)
    out = {}
    for k, v in raw.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out[k] = _lists_from_scalars(v, key + ".")
        elif str(known.get(key, "")).startswith("list") and v is not None and not isinstance(v, list):
            out[k] = [v]
        else:
            out[k] = v
    return out


def _strip_hydra_prefix(override: str) -> str:
    """``+key=value`` / ``++key=value`` (Hydra: add / force-add a key) set a key like ``key=value``;
    the key itself must still be one this config knows."""
    return override.lstrip("+")


def load_config(
    yaml_path: str | None = None, overrides: list[str] | None = None, notices: list[str] | None = None
) -> Config:
    """Defaults <- YAML file <- dotted overrides; returns a typed, resolved :class:`Config`.

    verl's keys that this config does not hold are handled by :mod:`megatron_rl.verl_compat`
    (aliased, refused in one line, or ignored with a line appended to ``notices``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_rl.verl_compat import translate

    known = set(known_keys(Config))
    notices = [] if notices is None else notices

    merged = OmegaConf.structured(Config)
    layers = []
    if yaml_path:
        if not os.path.exists(yaml_path):
            raise ConfigError(f"Config file not found: {yaml_path}")
        loaded = OmegaConf.load(yaml_path)
        if not isinstance(OmegaConf.to_container(loaded, resolve=False), dict):
            raise ConfigError(f"{yaml_path}: the top level of a config file must be a mapping of sections.")
        layers.append((loaded, yaml_path))
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"Overrides must look like key=value; got {bad}")
        overrides = [_strip_hydra_prefix(o) for o in overrides]
        layers.append((OmegaConf.from_dotlist(list(overrides)), "command line"))
    for layer, source in layers:
        try:
            raw = translate(OmegaConf.to_container(layer, resolve=False), known, source, notices)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_keys(raw, source)
        layer = OmegaConf.create(_lists_from_scalars(raw))
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            why = (e.msg or str(e) or type(e).__name__).splitlines()[0]
            raise ConfigError(f"Bad value for '{key}' (from {source}): {why}") from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"Config could not be resolved at '{getattr(e, 'full_key', '?')}': {e.msg}"
        ) from None
    _fill_derived(cfg)
    return cfg


def _fill_derived(cfg: Config) -> None:
    """Defaults that are defined in terms of other keys (one source of truth for each value)."""
    arr = cfg.actor_rollout_ref
    am = arr.actor.megatron
    # None means "the default"; 0 stays 0 and fails validation (it is no layout)
    if am.tensor_model_parallel_size is None:
        am.tensor_model_parallel_size = 1
    if am.pipeline_model_parallel_size is None:
        am.pipeline_model_parallel_size = 1
    for m in (arr.ref.megatron, cfg.critic.megatron, cfg.reward_model.megatron):
        if m.tensor_model_parallel_size is None:
            m.tensor_model_parallel_size = am.tensor_model_parallel_size
        if m.pipeline_model_parallel_size is None:
            m.pipeline_model_parallel_size = am.pipeline_model_parallel_size
    if not cfg.critic.model.path:
        cfg.critic.model.path = arr.model.path
    if cfg.critic.ppo_mini_batch_size is None:
        cfg.critic.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
    if cfg.critic.ppo_epochs is None:
        cfg.critic.ppo_epochs = arr.actor.ppo_epochs
    for section in (arr.rollout, arr.ref):
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = arr.actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = arr.actor.ppo_max_token_len_per_gpu
    if cfg.critic.use_dynamic_bsz is None:
        cfg.critic.use_dynamic_bsz = arr.actor.use_dynamic_bsz
    if cfg.critic.forward_max_token_len_per_gpu is None:
        cfg.critic.forward_max_token_len_per_gpu = cfg.critic.ppo_max_token_len_per_gpu
    if cfg.critic.enable is None:
        cfg.critic.enable = cfg.algorithm.adv_estimator == "gae"
    if cfg.data.tokenizer is None:
        cfg.data.tokenizer = arr.model.tokenizer_path or arr.model.path
    if arr.actor.loss_scale_factor is None:
        arr.actor.loss_scale_factor = cfg.data.max_response_length
    if arr.actor.clip_ratio_low is None:
        arr.actor.clip_ratio_low = arr.actor.clip_ratio
    if arr.actor.clip_ratio_high is None:
        arr.actor.clip_ratio_high = arr.actor.clip_ratio
    if cfg.trainer.log_dir is None:
        cfg.trainer.log_dir = os.path.join(cfg.trainer.default_local_dir, "logs")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
