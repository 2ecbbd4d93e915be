"""LoRA's config section (``actor_rollout_ref.model.lora``, ``critic.model.lora``, verl's keys) and its
checks: which of megatron's linear layers take adapters, named as verl names them or as an HF model
does (``q_proj`` ... ``down_proj``, ``all-linear``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.errors import ConfigError

LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""megatron's linear layers of a decoder layer that take adapters (verl's target_modules names)."""

MLA_LINEARS = (
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
"""Multi-latent attention's query and key-value projections (DeepSeek-V3): ``linear_qkv`` stands for
them on such a model, or they are named one by one."""

HF_NAMES = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
"""An HF model's projections -> the fused megatron linear that holds them."""


@dataclass
class LoraConfig:
    rank: int = 0
    """Adapter rank r; 0 = LoRA off (every weight trains). On: the model's weights are frozen and only
    the adapters (and a critic's value head) train; the reference model is the actor with its adapters
    switched off (no second copy of the weights)."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in training passes only."""
    target_modules: list[str] = field(default_factory=lambda: list(LINEARS))
    """Linear layers that take an adapter: linear_qkv, linear_proj, linear_fc1, linear_fc2 (or
    all-linear); HF names are accepted (q_proj, k_proj and v_proj together: one fused linear_qkv). On
    multi-latent attention linear_qkv means its q and kv projections (or name them: linear_q_down_proj,
    ...). An fnmatch pattern over the module's global name picks single layers' linears
    (``*.layers.0.*.linear_qkv``; routed experts are picked by name only)."""
    exclude_modules: list[str] = field(default_factory=list)
    """Linear layers left without an adapter: a target name, or an fnmatch pattern over the module's
    global name (``decoder.layers.0.*``)."""
    lora_A_init_method: str = "xavier"
    """A's initialisation: xavier (uniform, +-sqrt(6 / (in + rank))) or kaiming (uniform, +-1/sqrt(in),
    PEFT's); B starts at zero, so the model starts as the base."""
    merge: bool = True
    """How the rollout engine gets the adapters. true: base + scale * B @ A merged into the streamed
    weights, the whole model at every sync (on one H200, Qwen2.5-1.5B, rank 32: the faster step,
    6.28 s against 7.25 s, since SGLang's LoRA kernels slow generation by more than the smaller sync
    saves; docs/lora.md); false: into the engine's own LoRA support (SGLang's in-process adapters, the
    transformers engine's hooks), the frozen base streamed once (at the first sync and after an engine
    restart), only the adapters at every later sync: the colocated engine, models without routed
    experts or multi-latent attention. Only the actor's value counts (the critic never reaches an
    engine)."""
    adapter_path: str | None = None
    """Start from saved adapters: a PEFT directory (adapter_model.safetensors, as ckpt_tools
    export-peft writes) for this model; None = A random, B zero (the model starts as the base)."""


def lora_targets(spec: LoraConfig, key: str) -> tuple[str, ...]:
    """The megatron linears of ``spec.target_modules`` (``key``: the section, for the error line)."""
    names = spec.target_modules
    if isinstance(names, str):
        names = [names]
    if "all-linear" in names:
        return LINEARS + MLA_LINEARS
    out: list[str] = []
    for name in names:
        if "*" in name or "." in name:  # a pattern over the module's global name: verl's wildcards
            if not name.endswith(LINEARS + MLA_LINEARS):
                raise ConfigError(
                    f"{key}.target_modules: {name!r} names no linear a pattern can pick; end it with one of "
                    f"{', '.join(LINEARS + MLA_LINEARS)} ('*.layers.0.*.linear_qkv')."
                )
            out += [name]
            continue
        target = name if name in LINEARS + MLA_LINEARS else HF_NAMES.get(name)
        if target is None:
            raise ConfigError(
                f"{key}.target_modules: unknown module {name!r}; use {', '.join(LINEARS)} or all-linear."
            )
        if target == "linear_qkv":
            out += [t for t in MLA_LINEARS if t not in out]
        out += [] if target in out else [target]
    for fused in ("linear_qkv", "linear_fc1"):
        parts = [hf for hf, t in HF_NAMES.items() if t == fused]
        named = [p for p in parts if p in names]
        left = [p for p in parts if p not in names]
        if named and left and fused not in names:
            raise ConfigError(
                f"{key}.target_modules names {', '.join(named)} but not {', '.join(left)}: "
                f"{'/'.join(parts)} are one fused {fused} here, which takes one adapter; list all of them "
                f"(or {fused})."
            )
    patterns = tuple(t for t in out if t not in LINEARS + MLA_LINEARS)
    return tuple(t for t in LINEARS + MLA_LINEARS if t in out) + patterns


def check_lora(cfg) -> None:
    """The LoRA sections' names (the ranges are config.ranges'); one line naming the key."""
    for key, spec in (
        ("actor_rollout_ref.model.lora", cfg.actor_rollout_ref.model.lora),
        ("critic.model.lora", cfg.critic.model.lora),
    ):
        if spec.rank == 0:
            continue
        lora_targets(spec, key)
    spec = cfg.actor_rollout_ref.model.lora
    placement = cfg.trainer.placement
    separate = placement.rollout is not None or placement.file is not None
    if spec.rank and not spec.merge and separate:
        raise ConfigError(
            "actor_rollout_ref.model.lora.merge=false: the engine's own LoRA support is wired for the "
            "colocated engine only (trainer.placement.rollout / file place it apart); set it to true."
        )


def engine_lora_of(cfg) -> EngineLora | None:
    """What the colocated engine must be started with to take the actor's adapters unmerged
    (``lora.merge=false``), or None (no adapters, or merged into the stream)."""
    spec = cfg.actor_rollout_ref.model.lora
    return engine_lora(spec) if spec.rank > 0 and not spec.merge else None


@dataclass(frozen=True)
class EngineLora:
    """What an engine with its own LoRA support must be started with to take the actor's adapters."""

    rank: int
    hf_targets: tuple[str, ...]
    """The HF projections that take adapters (``q_proj`` ... ``down_proj``: SGLang's target modules)."""


def engine_lora(spec: LoraConfig) -> EngineLora:
    """The engine's start-up view of an adapter config (patterns name their linear by its last part)."""
    linears = {t.rsplit(".", 1)[-1] for t in lora_targets(spec, "actor_rollout_ref.model.lora")}
    hf = tuple(sorted(h for h, t in HF_NAMES.items() if t in linears))
    return EngineLora(spec.rank, hf)
