"""Pre-flight checks of a launch, on every rank before any process group starts.

The trainer (``megatron_rl.train.main``)::

    with explain_failures():
        cfg = load_config(path, overrides)
        preflight(cfg, world_size)        # layout, device, rollout engine, model paths, logger, validate
        ...                               # init_parallel, Trainer(cfg, ps).fit()

Each check raises a one-line :class:`~megatron_rl.errors.LaunchError` or ``ConfigError``, which
:func:`megatron_rl.run.explain.explain_failures` prints without a traceback. The dry run
(``python -m megatron_rl.config FILE.yaml --nproc N``, :func:`dry_run`) runs the same
:func:`checks` and reports every failure.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from megatron_rl.config import ConfigError, validate
from megatron_rl.config.placement import resolve_placement
from megatron_rl.errors import LaunchError
from megatron_rl.run.explain import PREFIX, explain_text, no_gpu_for_local_rank


def preflight(
    cfg: Any,
    world_size: int,
    env: Mapping[str, str] | None = None,
    typed: Mapping[str, Any] | None = None,
) -> None:
    """Check that this launch can run ``cfg`` before any process group starts, then ``config.validate``.

    Raises :class:`LaunchError` (launch layout, device) or ``ConfigError`` (logger packages, model
    paths, validate), each a one-line message. ``env`` defaults to ``os.environ`` (torchrun's
    LOCAL_RANK, LOCAL_WORLD_SIZE); ``typed``: values as the user wrote them (``load_config(typed=)``),
    named in messages about keys whose value was rewritten.
    """
    for _, check in checks(cfg, world_size, env, typed):
        check()


def checks(
    cfg: Any,
    world_size: int,
    env: Mapping[str, str] | None = None,
    typed: Mapping[str, Any] | None = None,
    device: bool = True,
) -> list[tuple[str, Callable[[], None]]]:
    """The pre-flight checks in the trainer's order, as (name, check) pairs: :func:`preflight` runs them
    and stops at the first failure, the dry run (``python -m megatron_rl.config``) runs every one.
    ``device=False`` leaves out what depends on this machine's GPUs."""
    env = os.environ if env is None else env
    typed = typed or {}
    out: list[tuple[str, Callable[[], None]]] = [
        ("launch layout", lambda: _check_layout(cfg, world_size, env))
    ]
    if device:
        out.append(("device", lambda: _check_device(cfg.trainer.device, env)))
    out += [
        ("rollout engine", lambda: _check_rollout_engine(cfg, typed, device)),
        ("model paths", lambda: _check_model_paths(cfg)),
        ("models", lambda: _check_models(cfg)),
        ("tools", lambda: _check_tools(cfg)),
        ("logger", lambda: check_logger_packages(cfg.trainer.logger)),
        ("config", lambda: validate(cfg, world_size=world_size)),
    ]
    return out


def _check_layout(cfg: Any, world_size: int, env: Mapping[str, str]) -> None:
    mp = cfg.actor_rollout_ref.actor.megatron
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    per_node = int(env.get("LOCAL_WORLD_SIZE", world_size))
    nodes = max(1, world_size // max(per_node, 1))
    train = len(resolve_placement(cfg, world_size).actor)  # the actor's ranks (trainer.placement)
    if tp >= 1 and pp >= 1 and train % (tp * pp):
        who = f"world size {world_size}"
        if train != world_size:  # the actor's ranks are the ones that must fit
            ranks = f"{train} actor rank{'s' if train > 1 else ''}"
            who = f"the {ranks} of trainer.placement.actor (world size {world_size})"
        raise LaunchError(
            f"{who} ({nodes} node(s) x {per_node} process(es) per node) does not "
            f"fit the parallel layout TP={tp} x PP={pp}: launch a multiple of {tp * pp} processes "
            "(launch/torchrun.sh --nproc, torchrun --nproc_per_node, sbatch --nodes) or set "
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size x pipeline_model_parallel_size "
            f"to a divisor of {train}.",
            same_on_all_ranks=True,
        )
    for key, want, got in (
        ("trainer.nnodes", cfg.trainer.nnodes, nodes),
        ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node, per_node),
    ):
        if want is not None and want != got:
            raise LaunchError(
                f"{key}={want} but this job was launched with {got} ({nodes} node(s) x {per_node} "
                f"process(es) per node): launch it to match, or leave {key} unset (the launch decides).",
                same_on_all_ranks=True,
            )


LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""trainer.logger sink -> the package it needs (not installed with megatron-rl)."""


def check_logger_packages(sinks: list[str]) -> None:
    """Every sink of trainer.logger can be opened: its package is installed (checked without importing
    it, before any model is built, on every rank; rank 0 alone writes the metrics)."""
    import importlib.util

    missing = [
        s for s in sinks if s in LOGGER_PACKAGES and importlib.util.find_spec(LOGGER_PACKAGES[s]) is None
    ]
    if missing:
        pkgs = " ".join(LOGGER_PACKAGES[s] for s in missing)
        kept = [s for s in sinks if s not in missing] or ["console"]
        raise ConfigError(
            f"trainer.logger={list(sinks)}: the {pkgs} package is not installed: pip install {pkgs}, or "
            f"set trainer.logger=[{','.join(kept)}] (metrics.jsonl is written either way)."
        )


def _check_rollout_engine(cfg: Any, typed: Mapping[str, Any], device: bool) -> None:
    """SGLang needs a GPU (rollout.check_engine_device) and its package; the message names the value as
    the user wrote it."""
    import importlib.util

    from megatron_rl.rollout import ENGINE_KEY, check_engine_device

    key, name = ENGINE_KEY, cfg.actor_rollout_ref.rollout.name
    if name != "sglang":
        return
    said = typed.get(key, name)
    shown = f"{key}={said}" + ("" if said == name else f" (run as {name} here: {said} is not bundled)")
    on_cpu = cfg.trainer.device == "cpu"
    if not on_cpu and device and cfg.trainer.device == "auto":
        import torch

        on_cpu = not torch.cuda.is_available()
    if on_cpu:
        where = "trainer.device=cpu" if cfg.trainer.device == "cpu" else "this machine has no GPU"
        check_engine_device(name, where, shown)
    if device and importlib.util.find_spec("sglang") is None:
        raise LaunchError(
            f"{shown} needs the sglang package, which is not installed: pip install -e '.[sglang]' "
            f"(docs/gpu.md), or set {key}=hf.",
            same_on_all_ranks=True,
        )


def _check_model_paths(cfg: Any) -> None:
    """Model and tokenizer paths are local directories (nothing is downloaded): one line if not."""
    for key, path in _model_paths(cfg):
        if not os.path.isdir(path):
            raise ConfigError(
                f"{key}={path}: no such directory. Point it at a local HF model directory or Megatron "
                "checkpoint (models are not downloaded from a hub)."
            )
        if key != "data.tokenizer":
            from megatron_rl.models.loading import detect_format

            try:
                detect_format(path)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"{key}={path}: {e}") from None


def _check_models(cfg: Any) -> None:
    """The models the run loads are ones this project builds and this run fits, read from their config
    (no weights): an architecture it does not build, an EP that does not divide the experts, a prompt
    plus response longer than the model's positions or its sliding window, or routing replay on a dense
    actor, is one line here rather than after the process groups start. A legacy Megatron-LM checkpoint
    (its args sit in a weights file) is read when it loads."""
    from megatron_rl.config.layout import check_expert_count, check_pipeline_split, check_replay_model
    from megatron_rl.model_args import check_sliding_window
    from megatron_rl.models.loading import detect_format, load_model_args_any

    for key, path in _model_paths(cfg):
        try:
            if key == "data.tokenizer" or detect_format(path) == "legacy":
                continue
        except (FileNotFoundError, ValueError):
            continue  # the model paths check says why
        args = load_model_args_any(path)
        check_expert_count(cfg, args.num_experts, path, engine=key == "actor_rollout_ref.model.path")
        check_pipeline_split(cfg, args.num_layers, key)
        _check_context(cfg, args.max_position_embeddings, key, path)
        if key == "actor_rollout_ref.model.path":
            check_replay_model(cfg, args.is_moe)
            check_sliding_window(args, cfg.data.max_prompt_length + cfg.data.max_response_length, path)


def _check_tools(cfg: Any) -> None:
    from megatron_rl.rollout.agent.tools import check_multi_turn_files

    check_multi_turn_files(cfg.actor_rollout_ref.rollout.multi_turn)


def _check_context(cfg: Any, positions: int, key: str, path: str) -> None:
    """A sequence (prompt + response, tool turns included) fits the model's positions: beyond them
    the engine refuses the request or the model's rotary embedding runs where it was never trained."""
    data = cfg.data
    total = data.max_prompt_length + data.max_response_length
    if total > positions:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {data.max_prompt_length} + "
            f"{data.max_response_length} = {total} exceeds the {positions} positions of {key}={path} "
            "(max_position_embeddings in its config.json): lower them to fit."
        )


def _model_paths(cfg: Any) -> list[tuple[str, str]]:
    """(key, path) of every model directory and tokenizer the run reads."""
    rm = cfg.reward_model
    out = [
        ("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path),
        ("critic.model.path", cfg.critic.model.path if cfg.critic.enable else None),
        ("reward_model.model.path", rm.model.path if rm.enable else None),
        ("data.tokenizer", cfg.data.tokenizer),
    ]
    return [(k, p) for k, p in out if p]


def _check_device(device: str, env: Mapping[str, str]) -> None:
    import torch

    from megatron_rl.parallel import resolve_device

    rank = env.get("RANK", "0")
    try:
        dev = resolve_device(device)
    except RuntimeError as e:
        raise LaunchError(explain_text(str(e), rank=rank) or f"rank {rank}: {e}") from None
    if dev.type == "cuda":
        local_rank, count = int(env.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local_rank >= count:
            raise LaunchError(no_gpu_for_local_rank(rank, local_rank, count))


# --------------------------------------------------------------------------------------------------
# The dry run: ``python -m megatron_rl.config FILE.yaml [key=value ...] [--nproc N] [--nnodes N]``
# --------------------------------------------------------------------------------------------------

# A validate() failure caused by one key's value alone (a choice, a range, a logger sink): the dry run
# resets that key and validates again, so that every such key is reported. Any other failure (sizes
# that do not divide, options that contradict) is reported and ends the checks, since a reset could
# only invent follow-up problems.
_ONE_KEY_FAILURE = re.compile(
    r"^(?P<key>[a-z_]+(?:\.[a-z_0-9]+)+)"
    r"(?:=.*? is not one of | is out of range|=.*? is out of range|: unknown sink)"
)


def _validate_all(cfg: Any, world_size: int) -> list[str]:
    """Every one-key value problem of ``cfg`` and the first problem of any other kind, one line each."""
    from megatron_rl.config import get_key, load_config

    cfg, defaults = copy.deepcopy(cfg), load_config(None, [])
    problems: list[str] = []
    seen: set[str] = set()
    while True:
        try:
            validate(cfg, world_size=world_size)
            return problems
        except ConfigError as e:
            problems += [f"config error: {p}" for p in getattr(e, "problems", None) or [e]]
            m = _ONE_KEY_FAILURE.match(str(e))
            if m is None or m["key"] in seen:
                return problems
            seen.add(m["key"])
            *path, leaf = m["key"].split(".")
            setattr(get_key(cfg, ".".join(path)) if path else cfg, leaf, get_key(defaults, m["key"]))


def dry_run(
    cfg: Any, nproc: int, nnodes: int = 1, typed: Mapping[str, Any] | None = None, device: bool = True
) -> list[str]:
    """What the trainer's pre-flight would stop at on a launch of ``nnodes`` x ``nproc`` processes, all of
    it: one line per problem (empty: the trainer would start building models). ``device=False`` leaves
    out what depends on this machine's GPUs (dry-running a GPU config on a login node)."""
    world = nproc * nnodes
    env = {"LOCAL_WORLD_SIZE": str(nproc), "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": str(world)}
    problems: list[str] = []
    layout_ok = True
    for name, check in checks(cfg, world, env, typed, device):
        if name == "config":
            if not layout_ok:  # said once already: check the rest at the nearest launch that fits
                mp = cfg.actor_rollout_ref.actor.megatron
                unit = max(1, (mp.tensor_model_parallel_size or 1) * (mp.pipeline_model_parallel_size or 1))
                world = unit * max(1, world // unit)
            problems += _validate_all(cfg, world)
            continue
        found = _problems_of(check)
        layout_ok = layout_ok and not (name == "launch layout" and found)
        problems += found
    # The trainer's own first checks (megatron_rl.trainer.Trainer), before it builds a model
    if not cfg.data.train_files:
        problems.append(
            "config error: data.train_files is empty: give one or more verl-format parquet files."
        )
    for key in ("data.train_files", "data.val_files"):
        problems += _problems_of(functools.partial(_check_data_files, cfg, key))
    return problems


def _problems_of(check: Callable[[], None]) -> list[str]:
    from megatron_rl.config import DataError

    try:
        check()
    except ConfigError as e:
        return [f"config error: {e}"]
    except DataError as e:
        return [f"data error: {e}"]
    except LaunchError as e:
        return [str(e)]
    return []


def _check_data_files(cfg: Any, key: str) -> None:
    from megatron_rl.data import check_files

    files = cfg.data.train_files if key == "data.train_files" else cfg.data.val_files
    check_files(files, cfg.data.prompt_key)


USAGE = """usage: python -m megatron_rl.config [--check] [--nproc N] [--nnodes N] [--no-device]
                                   [[--config] FILE.yaml] [key=value ...]
       python -m megatron_rl.config --keys [PREFIX]

A dry run of a launch: resolves the config as megatron_rl.train does (defaults <- FILE.yaml <- key=value
overrides), prints it, prints the notices the trainer would print, then runs every check the trainer
runs before it builds a model, for a job of --nnodes x --nproc processes (default: trainer.nnodes x
trainer.n_gpus_per_node, else one node with TP x PP processes). Every problem is one line on stderr;
the exit status is 1 if there is any. --check: the checks only, not the config. --no-device: leave
out what depends on this machine's GPUs (dry-running a GPU config on a login node).
--keys: every key (optionally only those starting with PREFIX) with its type, default and meaning.
Keys follow verl's names; `+key=value` works as `key=value`; a scalar given for a list key becomes a
one-element list."""


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_rl.config``: the dry run (:data:`USAGE`); returns the exit status."""
    import sys

    from megatron_rl.config import describe_keys, load_config, to_dict
    from megatron_rl.config.load import ConfigErrors

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "--keys":
        prefix = argv[1] if len(argv) > 1 else ""
        text = describe_keys(prefix)
        if not text:  # e.g. a training key asked of a frozen model's section: say so, not nothing
            from megatron_rl.config.load import known_keys, unknown_key_hint
            from megatron_rl.config.schema import Config

            print(f"no config key starts with '{prefix}'.{unknown_key_hint(prefix, known_keys(Config))}")
            return 1
        print(text)
        return 0
    from megatron_rl.verl_compat import hydra_config_args

    notices: list[str] = []
    argv = hydra_config_args(argv, notices)  # Hydra's --config-path/--config-name, as verl's scripts
    opts: dict[str, Any] = {"--check": False, "--no-device": False, "--nproc": None, "--nnodes": None}
    yaml_path: str | None = None
    overrides: list[str] = []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in ("--nproc", "--nnodes", "--config"):
            value = value if eq else next(it, "")
            if name == "--config":
                yaml_path = value
            elif not value.isdigit() or int(value) < 1:
                print(f"config error: {name} needs a positive number of processes/nodes", file=sys.stderr)
                return 2
            else:
                opts[name] = int(value)
        elif arg in ("--check", "--no-device"):
            opts[arg] = True
        elif arg.startswith("--"):
            print(f"config error: unknown option {arg}\n{USAGE}", file=sys.stderr)
            return 2
        elif "=" not in arg and yaml_path is None and not overrides:
            yaml_path = arg
        else:
            overrides.append(arg)

    typed: dict[str, Any] = {}
    dropped: list[str] = []  # bad keys: reported, and the rest of the config checked without them
    try:
        cfg = load_config(yaml_path, overrides, notices, typed, dropped)
    except ConfigErrors as e:
        problems = [f"config error: {p}" for p in [*dropped, *e.problems]]
    except ConfigError as e:
        problems = [f"config error: {p}" for p in [*dropped, e]]
    else:
        problems = [f"config error: {p}" for p in dropped]
        if not opts["--no-device"]:  # the device this machine would run it on
            from megatron_rl.optim import precision_notices

            notices += precision_notices(cfg)
        if not opts["--check"]:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))), end="", flush=True)
        mp = cfg.actor_rollout_ref.actor.megatron
        nnodes = opts["--nnodes"] or cfg.trainer.nnodes or 1
        nproc = opts["--nproc"] or cfg.trainer.n_gpus_per_node
        if nproc is None:  # the smallest launch of the layout: its TP x PP grid and its expert grid
            tp, pp = mp.tensor_model_parallel_size or 1, mp.pipeline_model_parallel_size or 1
            experts = (mp.expert_tensor_parallel_size or tp) * (mp.expert_model_parallel_size or 1) * pp
            nproc = math.lcm(tp * pp, experts)
        problems += dry_run(cfg, nproc, nnodes, typed, device=not opts["--no-device"])
    for line in notices:
        print(f"megatron-rl: {line}", file=sys.stderr)
    for line in problems:
        print(PREFIX + line if not line.startswith(PREFIX) else line, file=sys.stderr)
    if problems:
        print(
            f"megatron-rl: dry run: {len(problems)} problem(s); the trainer would stop at the first.",
            file=sys.stderr,
        )
        return 1
    print(f"megatron-rl: dry run: OK for {nnodes} node(s) x {nproc} process(es)", file=sys.stderr)
    return 0
