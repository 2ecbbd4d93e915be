"""Transformer Engine's layers or megatron-core's local ones: verl's
``*.megatron.override_transformer_config.transformer_impl``, resolved once per process.

``transformer_engine`` (the default wherever ``transformer_engine.pytorch`` imports) builds each layer
from megatron-core's TE spec: RMSNorm fused into the next linear (the input norm's weight lives in
``linear_qkv``, the pre-MLP norm's in ``linear_fc1``), fused RoPE and SwiGLU; the core attention and
grouped experts stay the trainer's own (:func:`te_layer`).
``local`` builds megatron-core's local spec, which needs nothing beyond torch. One line says which
implementation runs, and why. Transformer Engine itself: ``launch/build_te.sh`` (docs/gpu.md).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Container, Mapping
from typing import Any

from megatron_rl.config.errors import ConfigError

TRANSFORMER_ENGINE = "transformer_engine"
LOCAL = "local"
IMPLS = (TRANSFORMER_ENGINE, LOCAL)
KEY = "*.megatron.override_transformer_config.transformer_impl"

TE_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
"""Local spec name -> TE spec name, for a layer's norms (the rest of a layer's names are shared).
The pre-MLP norm stays a module of its own in a mixture-of-experts layer (the router reads its output)."""

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

EXTRA_STATE = "._extra_state"
"""TE modules add one such entry per module to the state dict (quantization metadata, empty in bf16)."""


@functools.lru_cache(maxsize=1)
def te_import_error() -> str | None:
    """None where ``transformer_engine.pytorch`` imports, else why not (one line). Torch's cuDNN is
    loaded first by the package's import (``megatron_rl.models``)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any failure of an optional import means: not usable)
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first}"[:300]
    return None


def resolve_transformer_impl(requested: str | None, key: str = KEY) -> tuple[str, str]:
    """(implementation, one-line notice) for the value of ``key`` (None: not set).

    Unset: ``transformer_engine`` when it imports, ``local`` otherwise. ``transformer_engine`` asked
    for where it does not import, or an unknown value: ConfigError naming the key and the fix."""
    if requested is not None and requested not in IMPLS:
        raise ConfigError(f"{key}={requested!r}: choose one of {', '.join(IMPLS)}")
    why_not = te_import_error() if requested != LOCAL else None
    if requested == TRANSFORMER_ENGINE and why_not is not None:
        raise ConfigError(
            f"{key}=transformer_engine, but Transformer Engine does not import ({why_not}): install it "
            f"(launch/build_te.sh, docs/gpu.md) or set {key}=local"
        )
    if requested == LOCAL:
        return LOCAL, f"megatron-rl: megatron-core's local layers ({key}=local)"
    if why_not is None:
        how = "asked for" if requested else "the default where it imports"
        return TRANSFORMER_ENGINE, f"megatron-rl: Transformer Engine layers ({how}; local ones: {key}=local)"
    return LOCAL, f"megatron-rl: megatron-core's local layers: Transformer Engine does not import ({why_not})"


NOT_ON_TE = {
    "mla": "multi-latent attention",
    "lora": "LoRA adapters (on Transformer Engine's fused linears)",
}
"""What runs on the local layers only: an unset key picks ``local`` for them, ``transformer_engine``
is refused."""


def choose_impl(requested: str | None, key: str = KEY, local_only: Container[str] = ()) -> tuple[str, str]:
    """:func:`resolve_transformer_impl`, where the model needs the local layers for any of
    ``local_only`` (keys of :data:`NOT_ON_TE`): unset, ``local`` with the reason in the notice;
    ``transformer_engine`` asked for, a ConfigError naming the key and the fix."""
    needs = [what for k, what in NOT_ON_TE.items() if k in local_only]
    if needs and requested != LOCAL:
        if requested == TRANSFORMER_ENGINE:
            raise ConfigError(
                f"{key}=transformer_engine: {' and '.join(needs)} run on the local layers only: "
                f"set {key}=local"
            )
        resolve_transformer_impl(requested, key)  # unknown values: the same error as everywhere
        return LOCAL, f"megatron-rl: megatron-core's local layers ({' and '.join(needs)} run on them only)"
    return resolve_transformer_impl(requested, key)


FP8_KEY = "*.megatron.override_transformer_config.fp8"
FP8_TOKENS = 16
"""FP8 GEMMs take token counts in multiples of 16: every micro-batch's tokens per rank are padded to it."""


def check_fp8(fp8: str | None, impl: str, notice: str) -> None:
    """FP8 training (megatron-core's ``fp8`` under :data:`FP8_KEY`) runs through Transformer Engine's
    layers: refused, naming the key and why, on the local ones (``notice`` says why they were chosen)."""
    if fp8 and impl != TRANSFORMER_ENGINE:
        raise ConfigError(
            f"{FP8_KEY}={fp8!r} trains the linear layers in FP8 through Transformer Engine's layers, but "
            f"this model runs on the local ones ({notice.split(': ', 1)[-1]}): install Transformer Engine "
            f"on a Hopper or newer GPU (launch/build_te.sh, docs/gpu.md), or unset {FP8_KEY}"
        )


_ANNOUNCED: set[str] = set()


def announce(notice: str, rank: int) -> None:
    """Print ``notice`` once per process, on rank 0."""
    if rank == 0 and notice not in _ANNOUNCED:
        _ANNOUNCED.add(notice)
        print(notice, flush=True)


TE_FUSIONS = dict(apply_rope_fusion=True, bias_activation_fusion=True, bias_dropout_fusion=True)
"""TransformerConfig fusions turned on with Transformer Engine's layers (the local spec runs unfused):
TE's fused RoPE, the SwiGLU and the residual add fused by megatron's jit kernels."""


def te_config_kwargs() -> dict[str, Any]:
    """TransformerConfig fields of a model built on Transformer Engine's layers (TE builds its
    modules on the GPU directly)."""
    return dict(TE_FUSIONS, use_cpu_initialization=False, transformer_impl=TRANSFORMER_ENGINE)


def te_layer(num_experts: int | None, qk_layernorm: bool, experts: Any, core_attention: Any) -> Any:
    """One layer's TE spec with ``core_attention`` (a module class of megatron's core-attention
    signature) in place of TE's: the trainer's masks are arbitrary (left-padded prompts, padded
    responses), which TE's causal attention type does not read.

    ``experts`` (a mixture-of-experts layer's expert module; None: the TE spec's SequentialMLP of TE
    linears): the trainer passes its grouped-matmul experts (``models.experts.GroupedExperts``), not
    TE's ``TEGroupedMLP``, whose GroupedLinear runs one GEMM per expert unless cuBLASLt has grouped
    GEMMs (13.4 on Hopper); docs/benchmarks.md measures the two in a PPO step."""
    layer = te_layer_spec(num_experts, qk_layernorm=qk_layernorm, moe_grouped_gemm=False)
    layer.submodules.self_attention.submodules.core_attention = core_attention
    if num_experts and experts is not None:
        layer.submodules.mlp.submodules.experts = experts
    return layer


def te_global_names(params: Mapping[str, Any]) -> dict[str, Any]:
    """A TE model's named tensors under the local spec's names (the layout tables'), extra state dropped."""
    return {te_to_local_name(n): p for n, p in params.items() if not is_extra_state(n)}


def te_layer_spec(
    num_experts: int | None = None,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    moe_grouped_gemm: bool = True,
) -> Any:
    """megatron-core's TE layer spec (a ``ModuleSpec``) for one dense or mixture-of-experts layer.

    Needs Transformer Engine; its norms are RMSNorm or LayerNorm as the TransformerConfig's
    ``normalization`` says (TE picks at build time)."""
    why_not = te_import_error()
    if why_not is not None:
        raise RuntimeError(f"the Transformer Engine layer spec needs Transformer Engine ({why_not})")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
    )


def local_to_te_name(name: str, te_names: Container[str] | None = None) -> str:
    """A local-spec parameter name -> the TE spec's name for the same tensor.

    A layer's norm moves into the linear that follows it where the TE model has that fused name
    (``te_names``: the TE model's names; None: assume it has, as every dense layer with standard
    attention does; a mixture-of-experts layer keeps ``pre_mlp_layernorm``, multi-latent attention
    ``input_layernorm``). Experts: ``local_experts.{j}.linear_fc{k}.weight`` (SequentialMLP) ->
    ``linear_fc{k}.weight{j}`` (TEGroupedMLP)."""
    if m := _LOCAL_EXPERT.search(name):
        return f"{name[: m.start()]}.mlp.experts.{m.group(2)}.weight{m.group(1)}"
    for local, te in TE_FUSED_NORMS.items():
        if name.endswith("." + local):
            fused = name[: -len(local)] + te
            return fused if te_names is None or fused in te_names else name
    return name


def te_to_local_name(name: str) -> str:
    """A TE spec parameter name -> the local spec's (the inverse of :func:`local_to_te_name`)."""
    if m := _TE_EXPERT.search(name):
        return f"{name[: m.start()]}.mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight"
    for local, te in TE_FUSED_NORMS.items():
        if name.endswith("." + te):
            return name[: -len(te)] + local
    return name


def is_extra_state(name: str) -> bool:
    """Whether a state-dict entry is TE's per-module extra state rather than a tensor of the model."""
    return name.endswith(EXTRA_STATE)
