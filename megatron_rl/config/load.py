"""Loading: dataclass defaults <- a YAML file <- dotted command-line overrides, verl's keys translated
(megatron_rl.verl_compat), derived defaults filled from other keys (one source of truth each)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, cast

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.model_sections import TRAINED_MEGATRON_SECTIONS, TRAINED_ONLY_KEYS
from megatron_rl.config.schema import ActorConfig, Config, CriticConfig
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


class ConfigErrors(ConfigError):
    """Every problem of a config at once (one line each, in ``problems``), raised by :func:`load_config`
    when a YAML file or command line holds more than one bad key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def _key_problems(raw: dict, source: str) -> list[tuple[str, str]]:
    """(key, one-line problem) for every key of ``raw`` this config does not know."""
    known = known_keys(Config)
    # Keys under a dict-typed field (custom_reward_function.reward_kwargs.*) are the user's own.
    free = tuple(k + "." for k, t in known.items() if str(t).startswith("dict"))
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k}
    out = []
    for key, value in leaves(raw):
        if key in sections and value is not None:
            example = next(k for k in known if k.startswith(key + "."))
            out.append(
                (
                    key,
                    f"'{key}' (from {source}) is a section of keys, not a value: got {value!r}; write its "
                    f"keys under it (e.g. {example}=...).",
                )
            )
        elif key not in known and not key.startswith(free):
            out.append((key, f"Unknown config key '{key}' (from {source}).{unknown_key_hint(key, known)}"))
    return out


def unknown_key_hint(key: str, known: dict[str, Any]) -> str:
    """What an unknown key may have meant: a training-only key on a forward-only model's megatron
    section says where it applies; any other key gets a did-you-mean."""
    section, _, leaf = key.rpartition(".")
    if section.endswith(".megatron") and section in known and leaf in TRAINED_ONLY_KEYS:
        return (
            f" {leaf} applies only to trained models ({' / '.join(TRAINED_MEGATRON_SECTIONS)}): "
            f"{section.rsplit('.', 1)[0]} runs forward passes only; drop the key."
        )
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" Did you mean '{near[0]}'?" if near else ""


def _merge_into(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge_into(dst[k], v)
        else:
            dst[k] = v


def _nest(key: str, value: Any) -> dict:
    out: dict = {}
    d = out
    *path, leaf = key.split(".")
    for p in path:
        d = d.setdefault(p, {})
    d[leaf] = value
    return out


def _drop(raw: dict, key: str) -> None:
    """Remove ``key`` (dotted) from the nested dict ``raw``, and sections it leaves empty."""
    *path, leaf = key.split(".")
    chain = [raw]
    for p in path:
        if not isinstance(chain[-1].get(p), dict):
            return
        chain.append(chain[-1][p])
    chain[-1].pop(leaf, None)
    for d, p in zip(reversed(chain[:-1]), reversed(path), strict=True):
        if d[p] == {}:
            del d[p]


def _lists_from_scalars(raw: dict, prefix: str = "") -> dict:
    """A scalar given for a list-typed key becomes a one-element list (``data.train_files=x.parquet``,
    ``trainer.logger=console``), as verl's command lines write them."""
    known = known_keys(Config)
    out: dict[str, Any] = {}
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


def shipped_config_dirs() -> list[str]:
    """Where the configs of yaml/ are: megatron_rl/configs in an installed wheel (setup.py ships them
    there), yaml/ beside the package in a checkout."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [os.path.join(package, "configs"), os.path.join(os.path.dirname(package), "yaml")]
    return [d for d in dirs if os.path.isdir(d)]


def find_config(path: str) -> str:
    """``path`` itself when it exists (``~`` expanded), else a shipped config of that name
    (``cpu_demo.yaml``, ``yaml/cpu_demo.yaml``); a one-line ConfigError otherwise."""
    path = os.path.expanduser(path)
    if os.path.exists(path):
        return path
    if not os.path.isabs(path):
        for d in shipped_config_dirs():
            cand = os.path.join(d, os.path.basename(path))
            if os.path.isfile(cand):
                return cand
    shipped = sorted({f for d in shipped_config_dirs() for f in os.listdir(d) if f.endswith(".yaml")})
    hint = f"; the shipped configs are {', '.join(shipped)}" if shipped else ""
    raise ConfigError(f"Config file not found: {path}{hint}")


def load_config(
    yaml_path: str | None = None,
    overrides: list[str] | None = None,
    notices: list[str] | None = None,
    typed: dict[str, Any] | None = None,
    dropped: list[str] | None = None,
) -> Config:
    """Defaults <- YAML file <- dotted overrides; returns a typed, resolved :class:`Config`.

    verl's keys that this config does not hold are handled by :mod:`megatron_rl.verl_compat`
    (aliased, refused in one line, or ignored with a line appended to ``notices``). Every bad key of
    every layer is reported at once: :class:`ConfigErrors`, one line per key. ``typed``, when given,
    receives the value as written of each key whose value verl_compat rewrote (``rollout.name=vllm``),
    so that later messages can name what the user typed. ``dropped``, when given, receives those
    problems instead, and the config is built from the keys that are left (the dry run checks the rest
    of the config beside the bad keys).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megatron_rl.verl_compat import VALUE_REWRITES, translate

    known = set(known_keys(Config))
    notices = [] if notices is None else notices
    problems: list[str] = []

    merged = OmegaConf.structured(Config)
    layers = []
    if yaml_path:
        yaml_path = find_config(yaml_path)
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
        raw: dict = {}
        # Key by key, so that every refused key of the layer is reported, not only the first.
        for key, value in leaves(OmegaConf.to_container(layer, resolve=False)):
            if typed is not None and isinstance(value, str) and (key, value) in VALUE_REWRITES:
                typed[key] = value
            try:
                one = translate(_nest(key, value), known, source, notices)
            except ValueError as e:
                problems.append(str(e))
                continue
            _merge_into(raw, one)
        for key, problem in _key_problems(raw, source):
            problems.append(problem)
            _drop(raw, key)
        raw = _lists_from_scalars(raw)
        while True:  # a value of the wrong type: named, dropped, and the rest of the layer merged
            try:
                merged = OmegaConf.merge(merged, OmegaConf.create(raw))
                break
            except OmegaConfBaseException as e:
                key = getattr(e, "full_key", None) or "?"
                why = (e.msg or str(e) or type(e).__name__).splitlines()[0]
                problems.append(f"Bad value for '{key}' (from {source}): {why}")
                if key == "?" or not _has(raw, key):
                    break
                _drop(raw, key)
    if problems and dropped is not None:
        dropped += problems
    elif problems:
        raise ConfigErrors(problems) if len(problems) > 1 else ConfigError(problems[0])
    try:
        # merged is OmegaConf.structured(Config) merged with plain layers: to_object builds a Config
        cfg = cast(Config, OmegaConf.to_object(merged))
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"Config could not be resolved at '{getattr(e, 'full_key', '?')}': {e.msg}"
        ) from None
    _fill_derived(cfg)
    return cfg


def _has(raw: dict, key: str) -> bool:
    d: Any = raw
    for p in key.split("."):
        if not isinstance(d, dict) or p not in d:
            return False
        d = d[p]
    return True


def _fill_derived(cfg: Config) -> None:
    """Defaults that are defined in terms of other keys (one source of truth for each value)."""
    arr = cfg.actor_rollout_ref
    am = arr.actor.megatron
    # None means "the default"; 0 stays 0 and fails validation (it is no layout)
    if am.tensor_model_parallel_size is None:
        am.tensor_model_parallel_size = 1
    if am.pipeline_model_parallel_size is None:
        am.pipeline_model_parallel_size = 1
    for own in (am, cfg.critic.megatron):  # verl's critic has its own default, not the actor's
        if own.use_remove_padding is None:
            own.use_remove_padding = own.use_sdpa_attention
    for m in (arr.ref.megatron, cfg.critic.megatron, cfg.reward_model.megatron):
        if m.tensor_model_parallel_size is None:
            m.tensor_model_parallel_size = am.tensor_model_parallel_size
        if m.pipeline_model_parallel_size is None:
            m.pipeline_model_parallel_size = am.pipeline_model_parallel_size
        if m.virtual_pipeline_model_parallel_size is None:
            m.virtual_pipeline_model_parallel_size = am.virtual_pipeline_model_parallel_size
        if m.use_remove_padding is None:  # the critic's was filled above
            m.use_remove_padding = am.use_remove_padding
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
    # "~" in paths means the home directory, as in a shell (the paths reach no shell)
    cfg.data.train_files = [os.path.expanduser(f) for f in cfg.data.train_files]
    cfg.data.val_files = [os.path.expanduser(f) for f in cfg.data.val_files]
    for owner, key in (
        (cfg.data, "tokenizer"),
        (arr.model, "path"),
        (cfg.critic.model, "path"),
        (cfg.reward_model.model, "path"),
        (cfg.custom_reward_function, "path"),
        (cfg.trainer, "default_local_dir"),
    ):
        if isinstance(getattr(owner, key), str):
            setattr(owner, key, os.path.expanduser(getattr(owner, key)))
    if arr.rollout.dtype is None:
        arr.rollout.dtype = arr.actor.megatron.params_dtype
    for trained in (arr.actor, cfg.critic):
        fill_update_defaults(trained, cfg.data.max_response_length)
    if cfg.trainer.log_dir is None:
        cfg.trainer.log_dir = os.path.join(cfg.trainer.default_local_dir, "logs")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def fill_update_defaults(section: ActorConfig | CriticConfig, max_response_length: int) -> None:
    """An update section's derived keys: seq-mean-token-sum-norm's ``loss_scale_factor`` is
    ``data.max_response_length`` (never a batch's width, which differs between DP ranks and
    placements); the actor's ``clip_ratio_low`` / ``clip_ratio_high`` are ``clip_ratio``."""
    if section.loss_scale_factor is None:
        section.loss_scale_factor = max_response_length
    if isinstance(section, ActorConfig):
        if section.clip_ratio_low is None:
            section.clip_ratio_low = section.clip_ratio
        if section.clip_ratio_high is None:
            section.clip_ratio_high = section.clip_ratio
