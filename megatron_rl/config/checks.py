"""Validation of a loaded config as a whole, before any process group starts: choices (from the
algorithm registries), every numeric key's range, batch sizes against the data-parallel size, parallel
sizes against the model's head counts, and the algorithm options that depend on each other. Every
failure is a one-line ConfigError naming the key and the fix."""

from __future__ import annotations

import difflib
import json
import os

from megatron_rl.config.batch_sizes import check_batch_sizes, samples_per_draw
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.layout import (
    ENGINE_RANKS,
    _read_model_dims,
    check_engine_layout,
    check_expert_layout,
    check_interleaving,
    check_layout_against_model,
    check_router_replay,
    engine_ranks_text,
    parallel_sizes,
    uneven_stages,
    virtual_stages,
)
from megatron_rl.config.lora import check_lora
from megatron_rl.config.model_sections import FrozenMegatronConfig
from megatron_rl.config.placement import resolve_placement
from megatron_rl.config.ranges import check_ranges, get_key
from megatron_rl.config.schema import Config
from megatron_rl.config.specs import needs_reference

# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _choices() -> dict[str, tuple]:
    """Keys with a fixed set of values; the algorithm lists come from their registries in algos/."""
    from megatron_rl.algos import ADV_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES

    return {
        **_CHOICES,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
        "critic.loss_agg_mode": LOSS_AGG_MODES,
        "actor_rollout_ref.actor.kl_loss_type": KL_PENALTIES,
        "algorithm.kl_penalty": KL_PENALTIES,
        "algorithm.adv_estimator": tuple(ADV_ESTIMATORS),
        "actor_rollout_ref.actor.policy_loss.loss_mode": tuple(POLICY_LOSSES),
        "algorithm.rollout_correction.rollout_is": (None, "token", "sequence"),
    }


_CHOICES = {
    "data.truncation": ("error", "left", "right", "middle"),
    "actor_rollout_ref.rollout.name": ("sglang", "hf"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor_rollout_ref.actor.optim.lr_decay_style": ("constant", "cosine", "linear"),
    "critic.optim.lr_decay_style": ("constant", "cosine", "linear"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.device": ("auto", "cuda", "cpu"),
    "actor_rollout_ref.actor.megatron.params_dtype": ("float32", "bfloat16", "float16"),
    "actor_rollout_ref.actor.megatron.recompute_granularity": ("full", "selective"),
    "actor_rollout_ref.actor.megatron.recompute_method": ("uniform", "block"),
    "critic.megatron.recompute_granularity": ("full", "selective"),
    "critic.megatron.recompute_method": ("uniform", "block"),
    "actor_rollout_ref.rollout.dtype": ("float32", "bfloat16", "float16"),
    "actor_rollout_ref.rollout.multi_turn.format": ("hermes", "llama3_json"),
    "actor_rollout_ref.model.lora.lora_A_init_method": ("xavier", "kaiming"),
    "critic.model.lora.lora_A_init_method": ("xavier", "kaiming"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": ("left", "middle", "right"),
    "actor_rollout_ref.rollout.multi_turn.schedule": ("async", "lockstep"),
}


def _validate_token_budgets(cfg: Config) -> None:
    """With use_dynamic_bsz, every budget must hold the longest possible sequence (it is never cut)."""
    arr = cfg.actor_rollout_ref
    actor, ref, critic = arr.actor.megatron, arr.ref.megatron, cfg.critic.megatron
    # (switch, budget, the model's megatron section: its TP and sequence parallelism)
    passes: list[tuple[str, str, FrozenMegatronConfig]] = [
        (
            "actor_rollout_ref.actor.use_dynamic_bsz",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            actor,
        ),
        (
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            actor,
        ),
    ]
    if needs_reference(cfg):  # the reference model runs
        passes.append(
            (
                "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                ref,
            )
        )
    if cfg.critic.enable:
        passes += [
            ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", critic),
            ("critic.use_dynamic_bsz", "critic.forward_max_token_len_per_gpu", critic),
        ]
    for flag, key, mcfg in passes:
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        tp = mcfg.tensor_model_parallel_size or 1
        if tp > 1 and mcfg.sequence_parallel:
            longest = -(-longest // tp) * tp  # sequence parallelism pads each micro-batch to a multiple of TP
        budget = get_key(cfg, key)
        if get_key(cfg, flag) and budget is not None and budget < longest:
            raise ConfigError(
                f"{key}={budget} is shorter than the longest sequence, {longest} tokens "
                "(data.max_prompt_length + data.max_response_length): raise it to at least "
                f"{longest} (a sequence is never cut)."
            )


def validate(cfg: Config, world_size: int, model_dims: dict[str, int] | None = None) -> None:
    """Check the config as a whole for a job of ``world_size`` processes.

    ``model_dims`` (num_attention_heads, num_key_value_heads, num_layers, vocab_size) comes from the
    model's own config; when None it is read from actor_rollout_ref.model.path if that exists.
    Raises :class:`ConfigError` naming the key and the fix.
    """
    check_ranges(cfg)
    check_lora(cfg)
    for key, choices in _choices().items():
        value = get_key(cfg, key)
        if value not in choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in choices if c is not None], n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{key}={value!r} is not one of {list(choices)}.{hint}")
    for sink in cfg.trainer.logger:
        if sink not in ("console", "jsonl", "tensorboard", "wandb"):
            raise ConfigError(
                f"trainer.logger: unknown sink {sink!r}; use console, jsonl, tensorboard, wandb."
            )

    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    if not arr.model.path:
        raise ConfigError("actor_rollout_ref.model.path is empty: point it at an HF model directory.")

    # The training ranks: every rank unless trainer.placement gives the rollout ranks of its own.
    placement = resolve_placement(cfg, world_size)
    rollout_ranks = len(placement.rollout)
    job_size, world_size = world_size, len(placement.actor)

    tp, pp = parallel_sizes(actor.megatron, "actor_rollout_ref.actor.megatron")
    others = (
        ("actor_rollout_ref.ref", arr.ref.megatron),
        ("critic", cfg.critic.megatron),
        ("reward_model", cfg.reward_model.megatron),
    )
    for name, m in others:
        if (m.tensor_model_parallel_size, m.pipeline_model_parallel_size) != (tp, pp):
            raise ConfigError(
                f"{name}.megatron.tensor/pipeline_model_parallel_size = "
                f"{m.tensor_model_parallel_size}/{m.pipeline_model_parallel_size} differ from the actor's "
                f"{tp}/{pp}; all models share one parallel layout: set them equal."
            )
    vpp = virtual_stages(actor.megatron)
    for name, m in others:
        if virtual_stages(m, actor.megatron) != vpp:
            raise ConfigError(
                f"{name}.megatron.virtual_pipeline_model_parallel_size = {virtual_stages(m)} differs from "
                f"the actor's {vpp}; all models share one parallel layout: set them equal."
            )
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        who = (
            f"World size {world_size}"
            if world_size == job_size
            else f"The {world_size} actor rank{'s' if world_size > 1 else ''} of trainer.placement.actor "
            f"(of world size {job_size})"
        )
        raise ConfigError(
            f"{who} is not divisible by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size = {tp} x {pp}: change actor_rollout_ref.actor.megatron.* "
            f"or the number of processes."
        )
    check_expert_layout(cfg, world_size)
    check_router_replay(cfg, placement.separate_rollout)
    if rollout.multi_turn.enable and placement.separate_rollout and rollout.engine_ranks > 1:
        raise ConfigError(
            "actor_rollout_ref.rollout.multi_turn.enable=true on rollout ranks of their own "
            "(trainer.placement.rollout) runs with an engine on one rank only "
            "(actor_rollout_ref.rollout.tensor_model_parallel_size=1, data_parallel_size=1): set them to 1, "
            "or colocate the rollout."
        )
    _check_agent_function(cfg, tp * pp, placement.separate_rollout)
    dp = world_size // (tp * pp)
    rtp = rollout.tensor_model_parallel_size
    check_engine_layout(rollout, rollout_ranks)

    check_batch_sizes(cfg, dp, tp, pp, placement)
    _check_partial_rollout(cfg, dp, placement.separate_rollout)
    check_interleaving(cfg, dp, pp, vpp)
    _validate_token_budgets(cfg)
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of one prompt: "
            "set actor_rollout_ref.rollout.n >= 2."
        )
    if rollout.temperature <= 0:
        raise ConfigError(
            f"actor_rollout_ref.rollout.temperature={rollout.temperature} must be > 0 (log-probs are taken "
            "at the sampling temperature); for greedy rollouts set actor_rollout_ref.rollout.do_sample=False."
        )
    if actor.clip_ratio_c <= 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1.0.")
    _validate_algorithm_options(cfg)
    for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model"):
        m = get_key(cfg, section + ".megatron")
        if m.use_remove_padding and not m.use_sdpa_attention:
            raise ConfigError(
                f"{section}.megatron.use_remove_padding=true packs sequences, which megatron's local "
                f"dot-product attention ({section}.megatron.use_sdpa_attention=false) cannot run: set "
                "use_sdpa_attention=true (the default) or use_remove_padding=false."
            )
    trained = ("param_offload", "grad_offload", "optimizer_offload")
    for section, keys in (
        ("actor_rollout_ref.actor", trained),
        ("critic", trained),
        ("actor_rollout_ref.ref", ("param_offload",)),  # forward only: the type has no other offload
        ("reward_model", ("param_offload",)),
    ):
        for key in keys:
            v = getattr(get_key(cfg, section + ".megatron"), key)
            if not (v is True or v is False or v == "auto"):
                raise ConfigError(
                    f"{section}.megatron.{key}={v!r}: accepted true, false or auto (the memory planner "
                    "parks only what does not fit beside the rollout engine)."
                )
    perms = cfg.trainer.checkpoint_permissions
    if not (isinstance(perms, str) and len(perms) == 4 and perms[0] == "0" and set(perms) <= set("01234567")):
        raise ConfigError(
            f"trainer.checkpoint_permissions={perms!r} must be an octal mode as a quoted string, e.g. "
            '"0600" (owner only) or "0640" (group may read).'
        )
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path.")
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise ConfigError(
            "reward_model.enable=True needs reward_model.model.path: an HF ...ForSequenceClassification "
            "directory (one score output) or a Megatron checkpoint of one."
        )
    _check_reward_source(cfg)
    if cfg.reward_model.http.url and (cfg.reward_model.enable or cfg.custom_reward_function.path):
        raise ConfigError(
            "reward_model.http.url is set together with "
            f"{'reward_model.enable=True' if cfg.reward_model.enable else 'custom_reward_function.path'}: "
            "rewards come from one source; unset one of them."
        )
    if model_dims is None:
        model_dims = _read_model_dims(arr.model.path)
    if model_dims:
        am = arr.actor.megatron
        check_layout_against_model(model_dims, tp, pp, rtp, *uneven_stages(am), vpp=virtual_stages(am))
    if not placement.separate_rollout and rollout.name == "sglang":  # hf: a model on each DP leader only
        idle = placement.idle_colocated_engines(tp, pp, rollout.engine_ranks)
        if idle:
            sizes = [r for r in range(1, world_size + 1) if not world_size % r]
            fits = [r for r in sizes if not placement.idle_colocated_engines(tp, pp, r)]
            raise ConfigError(
                f"{engine_ranks_text(rollout)} leaves the colocated engines on ranks {idle} without "
                "prompts (each is fed by the first rank of an actor TP group of the first pipeline stage; "
                f"actor_rollout_ref.actor.megatron.tensor/pipeline_model_parallel_size={tp}/{pp}): make "
                f"{ENGINE_RANKS} one of {fits}."
            )


_PARTIAL = "actor_rollout_ref.rollout.partial_rollout=true"


def _check_partial_rollout(cfg: Config, dp: int, separate_rollout: bool) -> None:
    """rollout.partial_rollout: multi-turn episodes of the built-in agent loop on the training ranks,
    whole prompts per rank, a staleness bound that lets an episode outlive its step."""
    rollout = cfg.actor_rollout_ref.rollout
    if not rollout.partial_rollout:
        return
    why = None
    if not rollout.multi_turn.enable:
        why = "it carries multi-turn episodes across steps: set multi_turn.enable=true"
    elif rollout.multi_turn.agent_function.path:
        why = f"the episodes of {_AGENT}.path run to their end inside the harness: unset one of them"
    elif separate_rollout:
        why = "it runs on a colocated rollout: leave trainer.placement.rollout unset"
    elif rollout.max_staleness < 1:
        why = (
            "an episode carried into the next step lags the actor by one version at least: set "
            "actor_rollout_ref.rollout.max_staleness >= 1"
        )
    elif cfg.algorithm.filter_groups.enable:
        why = "DAPO's refills draw prompts of their own: set algorithm.filter_groups.enable=false"
    elif samples_per_draw(cfg, dp) != rollout.n:  # a prompt's samples would span ranks
        why = (
            f"each rank keeps whole prompts in flight: data.train_batch_size={cfg.data.train_batch_size} "
            f"must be a multiple of the {dp} data-parallel ranks"
        )
    if why:
        raise ConfigError(f"{_PARTIAL}: {why} (or set partial_rollout=false).")


_AGENT = "actor_rollout_ref.rollout.multi_turn.agent_function"


def _check_agent_function(cfg: Config, actor_mp: int, separate_rollout: bool) -> None:
    """multi_turn.agent_function: its file defines the function (parsed, not run), the endpoint binds a
    loopback address, and the engine answers on one rank (the server calls generate on its own
    schedule, which no other rank mirrors)."""
    import ast
    import ipaddress

    rollout = cfg.actor_rollout_ref.rollout
    mt, path = rollout.multi_turn, rollout.multi_turn.agent_function.path
    if not path:
        return
    if not mt.enable:
        raise ConfigError(
            f"{_AGENT}.path is set but actor_rollout_ref.rollout.multi_turn.enable=false: set it to true."
        )
    if not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(f"{_AGENT}.path={path}: no such file; point it at the .py file of the harness.")
    name = mt.agent_function.name
    try:
        with open(os.path.expanduser(path)) as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
        raise ConfigError(f"{_AGENT}.path={path} cannot be parsed as Python ({e}).") from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    defined |= {(a.asname or a.name) for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    if name not in defined:
        raise ConfigError(
            f"{_AGENT}.name={name!r}: {path} defines no top-level function of that name; set {_AGENT}.name."
        )
    if mt.format != "hermes":
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.format={mt.format!r} with {_AGENT}.path: the endpoint "
            "replies with Hermes tool calls only; set it to hermes."
        )
    for key in ("tool_config_path", "interaction_config_path"):
        if getattr(mt, key):
            raise ConfigError(
                f"actor_rollout_ref.rollout.multi_turn.{key} is set together with {_AGENT}.path: the agent "
                "function runs its own tools and users; unset one of them."
            )
    if separate_rollout or actor_mp > 1 or rollout.engine_ranks > 1:
        raise ConfigError(
            f"{_AGENT}.path needs an engine that answers on one rank (trainer.placement.rollout unset, "
            "actor_rollout_ref.actor.megatron.tensor/pipeline_model_parallel_size = 1 and "
            "actor_rollout_ref.rollout.tensor_model_parallel_size = 1 and data_parallel_size = 1): the "
            "endpoint calls generate on its own schedule, which other ranks do not mirror."
        )
    host = mt.endpoint.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.endpoint.host={host!r} is not a loopback address (the "
            "endpoint has no authentication): set it to 127.0.0.1."
        )


def _validate_algorithm_options(cfg: Config) -> None:
    """Loss scaling, mismatch correction, dynamic sampling and overlong shaping."""
    from megatron_rl.algos.rollout_corr import parse_is_threshold, parse_rs

    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    if actor.loss_scale_factor is not None and actor.loss_scale_factor <= 0:
        raise ConfigError(
            f"actor_rollout_ref.actor.loss_scale_factor={actor.loss_scale_factor} must be > 0 "
            "(or null for data.max_response_length)."
        )
    for key, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", cfg.critic.optim)):
        if optim.min_loss_scale > optim.initial_loss_scale:
            raise ConfigError(
                f"{key}.min_loss_scale={optim.min_loss_scale:g} is above {key}.initial_loss_scale="
                f"{optim.initial_loss_scale:g}: lower the minimum or raise the start."
            )
    corr = alg.rollout_correction
    if corr.rollout_is is not None:
        try:
            parse_is_threshold(corr.rollout_is_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.trainer.val_only and not cfg.data.val_files:
        raise ConfigError("trainer.val_only=True validates on data.val_files, which is empty: set it.")
    if corr.rollout_rs:
        try:
            parse_rs(corr.rollout_rs, corr.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    fg = alg.filter_groups
    if fg.enable:
        if fg.max_num_gen_batches < 0:
            raise ConfigError("algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit).")
        if fg.metric == "seq_final_reward" and alg.use_kl_in_reward:
            raise ConfigError(
                "algorithm.filter_groups.metric=seq_final_reward needs the KL-shaped rewards, which come "
                "after filtering here: use seq_reward (or acc), or algorithm.use_kl_in_reward=False."
            )
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not (0 < ob.len <= cfg.data.max_response_length and ob.penalty_factor >= 0):
        raise ConfigError(
            f"reward_model.overlong_buffer: len={ob.len} must be in (0, data.max_response_length="
            f"{cfg.data.max_response_length}] and penalty_factor={ob.penalty_factor} >= 0."
        )


def _check_reward_source(cfg: Config) -> None:
    """reward_model.http.url/proxy are http(s) URLs; reward_model.model.path exists and is not a causal
    LM (its config.json's architectures), so none of it is found after the models are built."""
    import urllib.parse

    http = cfg.reward_model.http
    for key, url in (("reward_model.http.url", http.url), ("reward_model.http.proxy", http.proxy)):
        if url is None:
            continue
        parsed = urllib.parse.urlsplit(str(url))
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(
                f"{key}={url!r} is not an http:// or https:// URL; set it to e.g. http://host:8000"
                f"{'/score' if key.endswith('url') else ''}."
            )
    path = cfg.reward_model.model.path
    if not (cfg.reward_model.enable and path):
        return
    if not os.path.exists(path):
        raise ConfigError(
            f"reward_model.model.path={path}: no such directory; point it at a local HF "
            "...ForSequenceClassification directory (one score output) or a Megatron checkpoint of one."
        )
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return  # a Megatron checkpoint: its own metadata is checked when it is loaded
    try:
        with open(cfg_file) as f:
            archs = list(json.load(f).get("architectures") or [])
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"reward_model.model.path={path}: cannot read config.json ({e}).") from None
    if archs and all(str(a).endswith("ForCausalLM") for a in archs):
        raise ConfigError(
            f"reward_model.model.path={path} is a causal LM ({', '.join(archs)}), not a reward model: give "
            "an HF ...ForSequenceClassification model with num_labels=1 (a score head)."
        )
