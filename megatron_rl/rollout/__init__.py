"""Rollout: the engine protocol (base.py), the reshard stream (reshard.py), and two engines:
SGLang in-process on GPU (sglang_engine.py) and transformers on CPU or GPU (hf_engine.py).

:func:`create_engine` is the one place that names the engines: base.py defines what an engine is
and imports none of them; each engine imports base.py; this package imports an engine's module only
when that engine is built (SGLang/transformers are imported there, so importing this package is cheap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_rl.errors import LaunchError
from megatron_rl.model_args import DTYPES, run_dtype
from megatron_rl.rollout.base import Generation, RolloutEngine, RolloutOOMError, SamplingParams, sample_seed

if TYPE_CHECKING:
    from megatron_rl.config import RolloutConfig
    from megatron_rl.config.lora import EngineLora
    from megatron_rl.model_args import ModelArgs
    from megatron_rl.parallel import ParallelState

__all__ = [
    "Generation",
    "RolloutEngine",
    "RolloutOOMError",
    "SamplingParams",
    "check_engine_device",
    "create_engine",
    "engine_dtype",
    "sample_seed",
]


def engine_dtype(name: str | None, ps: ParallelState) -> torch.dtype:
    """The dtype of the engine's weights, and so of the stream into it: ``rollout.dtype`` (``name``),
    fp32 on CPU (as the trainer's models there: CPU kernels have no bf16 speed-up)."""
    if name is None:
        raise ValueError("actor_rollout_ref.rollout.dtype is unresolved: config.validate sets it")
    return DTYPES[run_dtype(name, ps.device)]


ENGINE_KEY = "actor_rollout_ref.rollout.name"


def check_engine_device(name: str, no_gpu: str | None, shown: str | None = None) -> None:
    """SGLang runs on a GPU only; the one place that says so. ``no_gpu``: why there is none (e.g.
    "trainer.device=cpu"; None: there is one); ``shown``: the key and value as the user wrote them
    (default: as ``name``). The pre-flight asks from the config before anything starts;
    :func:`create_engine` from the rank's device, for the scripts and tests that build an engine
    without the pre-flight."""
    if name == "sglang" and no_gpu is not None:
        raise LaunchError(
            f"{shown or f'{ENGINE_KEY}={name}'} needs a GPU, and {no_gpu}: on CPU set {ENGINE_KEY}=hf "
            "(the transformers engine).",
            same_on_all_ranks=True,
        )


def create_engine(
    cfg: RolloutConfig,
    model_path: str,
    args: ModelArgs,
    ps: ParallelState,
    seed: int,
    cuda_graph_max_bs: int | None = None,
    routed_experts: bool = False,
    lora: EngineLora | None = None,
) -> RolloutEngine:
    """The engine named by ``actor_rollout_ref.rollout.name`` (collective: every rank calls it);
    ``cuda_graph_max_bs``: SGLang's largest captured decode batch (run.memory_plan.cuda_graph_max_bs);
    ``routed_experts``: able to return each token's experts (routing replay; the transformers engine
    always is); ``lora``: the actor's adapters come unmerged (config.lora.engine_lora_of; the
    transformers engine always takes them)."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={cfg.dtype!r}: choose one of {sorted(DTYPES)}")
    if cfg.name == "hf":
        from megatron_rl.rollout.hf_engine import HFEngine

        return HFEngine(args, ps, dtype=engine_dtype(cfg.dtype, ps), seed=seed)
    if cfg.name == "sglang":
        check_engine_device(cfg.name, None if ps.device.type == "cuda" else f"this rank runs on {ps.device}")
        from megatron_rl.rollout.sglang_engine import SGLangEngine

        extra = {"enable_return_routed_experts": True} if routed_experts else {}
        return SGLangEngine(
            cfg, args, ps, seed, model_path, cuda_graph_max_bs=cuda_graph_max_bs, lora=lora, **extra
        )
    raise ValueError(
        f"actor_rollout_ref.rollout.name={cfg.name!r}: choose 'sglang' (GPU) or 'hf' (transformers)"
    )
