"""The model-parallel layout against the model and across the models: TP and PP against the model's
head and layer counts (the trainer's validation and ckpt_tools both), every model's expert layout
against the actor's, and the resolved TP/PP sizes of a megatron section."""

from __future__ import annotations

import json
import os

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.model_sections import FrozenMegatronConfig


def parallel_sizes(mcfg: FrozenMegatronConfig, section: str) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes of the megatron section ``section`` as load_config resolves
    them (None: the actor's, the actor's None: 1); a ConfigError if they are still None."""
    tp, pp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size
    if tp is None or pp is None:
        raise ConfigError(
            f"{section}.tensor/pipeline_model_parallel_size = {tp}/{pp}: unresolved; load the config with "
            "load_config (it fills None from the actor's, then 1) or set both."
        )
    return tp, pp


def _read_model_dims(path: str) -> dict[str, int] | None:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return None
    with open(cfg_file) as f:
        hf = json.load(f)
    heads = hf.get("num_attention_heads")
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "num_layers": hf.get("num_hidden_layers"),
    }


TP_KEY = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"
ENGINE_RANKS = "actor_rollout_ref.rollout.tensor_model_parallel_size x data_parallel_size"


def engine_ranks_text(rollout) -> str:
    """The keys that size an engine, with their values: for the messages that name them."""
    return (
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} x "
        f"data_parallel_size={rollout.data_parallel_size}"
    )


ROLLOUT_EP_KEY = "actor_rollout_ref.rollout.expert_parallel_size"
PP_KEY = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"


def check_layout_against_model(
    dims: dict[str, int],
    tp: int,
    pp: int,
    rollout_tp: int | None = None,
    first: int | None = None,
    last: int | None = None,
    tp_key: str = TP_KEY,
    pp_key: str = PP_KEY,
    vpp: int = 1,
) -> None:
    """TP (and the rollout's TP) must divide the attention and key/value heads, PP the layers (or the
    layers the first / last stage do not take: ``first``, ``last``), ``vpp`` (model chunks per stage)
    each stage's layers. The trainer's config check; ``ckpt_tools`` runs it too, naming its own
    ``--tp``/``--pp``."""
    heads, kv, layers = dims["num_attention_heads"], dims["num_key_value_heads"], dims["num_layers"]
    sizes = [(tp_key, tp)] + (
        [] if rollout_tp is None else [("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp)]
    )
    for key, size in sizes:
        if heads % size or kv % size:
            raise ConfigError(
                f"{key}={size} must divide the model's attention heads ({heads}) and key/value heads ({kv}); "
                f"choose one of {[d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0]}."
            )
    if first is not None or last is not None or vpp > 1:
        try:
            pipeline_split(layers, pp, first, last, vpp)
        except ValueError as e:
            raise ConfigError(str(e).replace("*.", "actor_rollout_ref.actor.")) from None
    elif layers % pp:
        raise ConfigError(f"{pp_key}={pp} must divide the model's {layers} layers.")


EP_KEY = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"


def expert_layout(mcfg, actor_mcfg=None) -> tuple[int, int]:
    """(EP, expert TP) of one model's megatron section: None falls back to the actor's, then to
    EP = 1 and expert TP = the tensor-parallel size (megatron's default)."""
    ep = mcfg.expert_model_parallel_size
    etp = mcfg.expert_tensor_parallel_size
    if actor_mcfg is not None:
        ep = ep if ep is not None else actor_mcfg.expert_model_parallel_size
        etp = etp if etp is not None else actor_mcfg.expert_tensor_parallel_size
    tp = mcfg.tensor_model_parallel_size or 1
    return (1 if ep is None else ep), (tp if etp is None else etp)


def check_expert_layout(cfg, world_size: int) -> None:
    """Every model shares the actor's expert layout, and EP x expert TP x PP divides the world.
    Whether EP divides the number of experts needs the model's config: :func:`check_expert_count`."""
    arr = cfg.actor_rollout_ref
    am = arr.actor.megatron
    ep, etp = expert_layout(am)
    pp = am.pipeline_model_parallel_size or 1
    others = (
        ("actor_rollout_ref.ref", arr.ref.megatron),
        ("critic", cfg.critic.megatron),
        ("reward_model", cfg.reward_model.megatron),
    )
    for name, m in others:
        if expert_layout(m, am) != (ep, etp):
            raise ConfigError(
                f"{name}.megatron.expert_model_parallel_size/expert_tensor_parallel_size = "
                f"{expert_layout(m, am)} differ from the actor's {(ep, etp)}; all models share one "
                "parallel layout: set them equal."
            )
    if world_size % (ep * etp * pp):
        raise ConfigError(
            f"{EP_KEY}={ep}: expert_model_parallel_size x expert_tensor_parallel_size x "
            f"pipeline_model_parallel_size = {ep} x {etp} x {pp} does not divide the {world_size} training "
            "ranks: change it or the number of processes."
        )


def check_expert_count(cfg, num_experts: int, path: str, engine: bool = False) -> None:
    """EP divides the experts of the MoE model at ``path`` (``num_experts``; 0: dense), the rollout
    engine's EP too for the model the engine runs (``engine``): the pre-flight and the dry run read the
    model's config for it (models.builder checks again on the model it builds)."""
    ep, _ = expert_layout(cfg.actor_rollout_ref.actor.megatron)
    rollout = cfg.actor_rollout_ref.rollout
    sizes = [(EP_KEY, ep)]
    if engine and rollout.name == "sglang":
        sizes.append((ROLLOUT_EP_KEY, rollout.expert_parallel_size))
    for key, size in sizes:
        if key == ROLLOUT_EP_KEY and size > 1 and not num_experts:
            raise ConfigError(
                f"{key}={size} splits routed experts, and {path} is a dense model: set it to 1."
            )
        if num_experts and num_experts % size:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ConfigError(
                f"{key}={size} does not divide the {num_experts} experts of {path}: choose one of {divisors}."
            )


def check_engine_layout(rollout, rollout_ranks: int) -> None:
    """One SGLang engine spans ``rollout.engine_ranks`` ranks (tensor x data parallel), which divide the
    ``rollout_ranks``; its expert parallelism divides them (SGLang cuts each expert over the
    engine_ranks / expert_parallel_size ranks left). The transformers engine holds whole models."""
    r = rollout.engine_ranks
    if rollout_ranks % r:
        raise ConfigError(
            f"{engine_ranks_text(rollout)}: the {r} ranks one engine spans do not divide the "
            f"{rollout_ranks} rollout ranks."
        )
    ep = rollout.expert_parallel_size
    if rollout.name == "sglang" and r % ep:
        divisors = [d for d in range(1, r + 1) if r % d == 0]
        raise ConfigError(
            f"{ROLLOUT_EP_KEY}={ep} does not divide the engine's {r} ranks ({ENGINE_RANKS}): "
            f"choose one of {divisors}."
        )


REPLAY_KEY = "actor_rollout_ref.actor.router_replay.mode"


def check_replay_model(cfg, is_moe: bool) -> None:
    """Routing replay needs routers: refused on a dense actor (``is_moe``: its model args say so). The
    dry run and the trainer's pre-flight read the model's config for it; roles.models checks again on
    the model it builds."""
    arr = cfg.actor_rollout_ref
    mode = arr.actor.router_replay.mode
    if mode in ("R2", "R3") and not is_moe:
        raise ConfigError(
            f"{REPLAY_KEY}={mode} replays expert routing, but {arr.model.path} is a dense model: set it "
            "to disabled."
        )


def check_router_replay(cfg, separate_rollout: bool) -> None:
    """Routing replay's mode, and the runs it is built for (models/routing.py); whether the actor is an
    MoE model: :func:`check_replay_model`, where the model's config is read."""
    arr = cfg.actor_rollout_ref
    mode = arr.actor.router_replay.mode
    if mode not in ("disabled", "R2", "R3"):
        raise ConfigError(f"{REPLAY_KEY}={mode!r} is not one of ['disabled', 'R2', 'R3'].")
    if mode == "disabled":
        return
    m = arr.actor.megatron
    recompute = arr.model.enable_gradient_checkpointing and m.recompute_granularity is not None
    if recompute and (m.pipeline_model_parallel_size or 1) > 1:
        raise ConfigError(
            f"{REPLAY_KEY}={mode} with pipeline_model_parallel_size > 1 and activation recompute: a "
            "recomputed forward would replay another micro-batch's routing; set "
            "actor_rollout_ref.model.enable_gradient_checkpointing=false or PP=1."
        )
    if mode == "R2":  # the actor's own routing: any rollout
        return
    if arr.rollout.multi_turn.enable:
        raise ConfigError(
            f"{REPLAY_KEY}=R3 with actor_rollout_ref.rollout.multi_turn.enable=true: the routing of the "
            "appended tool/user tokens is not recorded by the engine; use R2 (the old-log-prob pass's "
            "routing) or disabled."
        )
    if separate_rollout:
        raise ConfigError(
            f"{REPLAY_KEY}=R3 runs with the colocated engine only: drop trainer.placement.rollout, or "
            "use R2 (the old-log-prob pass's routing)."
        )


FIRST_STAGE = "*.megatron.override_transformer_config.num_layers_in_first_pipeline_stage"
LAST_STAGE = "*.megatron.override_transformer_config.num_layers_in_last_pipeline_stage"
VPP_KEY = "*.megatron.virtual_pipeline_model_parallel_size"


def pipeline_split(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None, vpp: int = 1
) -> tuple[int, ...]:
    """Decoder layers of each pipeline stage, as megatron-core splits them: ``first`` on stage 0 and
    ``last`` on the last stage where given (``num_layers_in_first/last_pipeline_stage``), the others
    evenly over the remaining stages. With ``vpp`` > 1 (interleaved 1F1B) each stage's layers are cut
    into ``vpp`` equal model chunks and the result lists the pp x vpp virtual stages in model order:
    virtual stage ``v * pp + p`` is chunk v of pipeline rank p. A ValueError names the key to change."""
    given = [x for x in (first, last) if x is not None]
    if any(x < 1 for x in given):
        raise ValueError(
            f"{FIRST_STAGE} / {LAST_STAGE} = {first} / {last}: a pipeline stage needs >= 1 layer"
        )
    if given and pp == 1:
        raise ValueError(f"{FIRST_STAGE} / {LAST_STAGE} need pipeline_model_parallel_size > 1")
    if vpp < 1 or (vpp > 1 and pp == 1):
        raise ValueError(
            f"{VPP_KEY}={vpp} needs pipeline_model_parallel_size > 1 (interleaving cuts each pipeline "
            "stage into model chunks): set it to 1 (or None), or raise pipeline_model_parallel_size"
        )
    others, rest = pp - len(given), num_layers - sum(given)
    if (others == 0 and rest) or (others and (rest < others or rest % others)):
        if not given:
            raise ValueError(
                f"{pp} pipeline stages do not divide the model's {num_layers} layers: choose "
                "*.megatron.pipeline_model_parallel_size dividing them, or set "
                f"{FIRST_STAGE} / {LAST_STAGE}"
            )
        raise ValueError(
            f"{FIRST_STAGE} / {LAST_STAGE} = {first} / {last} leave {rest} of the model's {num_layers} "
            f"layers for {others} other stage(s): they must split evenly (>= 1 each)"
        )
    middle = rest // others if others else 0
    split = [middle] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    if vpp == 1:
        return tuple(split)
    if any(n % vpp for n in split):
        raise ValueError(
            f"{VPP_KEY}={vpp} must divide the decoder layers of every pipeline stage {tuple(split)} "
            f"(each stage holds {vpp} equal model chunks): change it, pipeline_model_parallel_size or "
            f"{FIRST_STAGE} / {LAST_STAGE}"
        )
    return tuple(split[p] // vpp for _ in range(vpp) for p in range(pp))


def virtual_stages(megatron, actor=None) -> int:
    """The model chunks per pipeline stage of a ``*.megatron`` section (its
    virtual_pipeline_model_parallel_size; None: the actor's section's, then 1)."""
    v = getattr(megatron, "virtual_pipeline_model_parallel_size", None)
    if v is None and actor is not None:
        v = getattr(actor, "virtual_pipeline_model_parallel_size", None)
    return 1 if v is None else int(v)


# the sections whose models run the model at each path (they share its layer count)
_SECTIONS = {
    "actor_rollout_ref.model.path": ("actor_rollout_ref.actor", "actor_rollout_ref.ref"),
    "critic.model.path": ("critic",),
    "reward_model.model.path": ("reward_model",),
}


def check_pipeline_split(cfg, num_layers: int, key: str) -> None:
    """Every section running the model at ``key`` (``num_layers`` decoder layers) splits it over its
    pipeline stages: the pre-flight and the dry run read the model's config for it; models.builder
    splits the same way."""
    for name in _SECTIONS.get(key, ()):
        section = cfg
        for part in name.split("."):
            section = getattr(section, part)
        m = section.megatron
        vpp = virtual_stages(m, cfg.actor_rollout_ref.actor.megatron)
        try:
            pipeline_split(num_layers, m.pipeline_model_parallel_size or 1, *uneven_stages(m), vpp=vpp)
        except ValueError as e:
            raise ConfigError(str(e).replace("*.", f"{name}.")) from None


def uneven_stages(megatron) -> tuple[int | None, int | None]:
    """A ``*.megatron`` section's (num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage)
    from its override_transformer_config (verl's keys; None where unset)."""
    o = megatron.override_transformer_config or {}
    return o.get("num_layers_in_first_pipeline_stage"), o.get("num_layers_in_last_pipeline_stage")


def check_interleaving(cfg, dp: int, pp: int, vpp: int) -> None:
    """Interleaved 1F1B (``vpp`` > 1) runs the micro-batches of a pass in groups of PP per model chunk:
    megatron-core needs their count to be a multiple of PP. The forward-only passes fill up their last
    group themselves (models.forward.run_pipeline) and dynamic batching splits its micro-batches to a
    multiple (microbatches.plan); an update of fixed-size micro-batches cannot (a filler would train),
    so its count (mini-batch samples per rank / micro-batch size) must already be one."""
    if vpp == 1:
        return
    if pp == 1:
        raise ConfigError(
            f"actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size={vpp} needs "
            "pipeline_model_parallel_size > 1: set it to 1 (or None), or raise pipeline_model_parallel_size."
        )
    n = cfg.actor_rollout_ref.rollout.n
    updates = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor, dp)]
    placed = cfg.trainer.placement
    if cfg.critic.enable and placed.file is None:  # a placement file: run_pipeline checks at run time
        # the critic's data-parallel size: over its own ranks where trainer.placement.critic lists them
        tp = cfg.critic.megatron.tensor_model_parallel_size or 1
        critic_dp = max(1, len(placed.critic) // (tp * pp)) if placed.critic else dp
        updates.append(("critic", cfg.critic, critic_dp))
    for key, sec, ranks in updates:
        if sec.use_dynamic_bsz or not sec.ppo_mini_batch_size or sec.ppo_micro_batch_size_per_gpu <= 0:
            continue
        rows = sec.ppo_mini_batch_size * n // ranks
        count = -(-rows // sec.ppo_micro_batch_size_per_gpu)
        if count % pp:
            fits = [m for m in range(1, rows + 1) if rows % m == 0 and (rows // m) % pp == 0]
            raise ConfigError(
                f"{key}.ppo_micro_batch_size_per_gpu={sec.ppo_micro_batch_size_per_gpu} gives {count} "
                f"micro-batch(es) per mini-batch ({key}.ppo_mini_batch_size x rollout.n / data-parallel "
                f"size = {rows} sequences), but interleaved pipelines (actor_rollout_ref.actor.megatron."
                f"virtual_pipeline_model_parallel_size={vpp}) need a multiple of "
                f"pipeline_model_parallel_size={pp}: choose one of {fits} or {key}.use_dynamic_bsz=true."
            )
