"""LoRA into the rollout engine without the base (``actor_rollout_ref.model.lora.merge=false``):
the frozen base is streamed once, then only the adapters cross at every sync.

    reshard.sync_weights(actor, ps, engine, ...)      asks unmerged() first:
      not unmerged (no LoRA, merge=true)
          -> the weight stream as usual (the adapters merged into it: models.lora.MergedParams)
      unmerged: sync_adapters
        engine.adapter_base False (a new engine: the first sync, a restart)
          -> the weight stream with the adapters switched off: the base's own weights, checked as
             every stream is (reshard.check_weights); engine.adapter_base = True
        models.lora_files.gather_peft: this stage's adapters, full, in PEFT's names
          (base_model.model.<hf module>.lora_{A,B}.weight; [r, in] and [out, r])
        -> every pipeline stage's (all_gather_object over PP) -> the engine dtype
        -> engine.load_adapters(tensors, PEFT adapter_config): every generate names the adapter

The engines: SGLang loads them with ``Engine.load_lora_adapter_from_tensors`` (started with
``enable_lora``; rollout.sglang_engine); the transformers engine adds scale * B A x to each adapted
projection's output (rollout.hf_engine). Both keep the base across ``release_memory``. The
sync-integrity probe (roles.sync_check: the engine's log-probs against the actor's) sees base +
adapters, so it covers this path.

Not taken unmerged (merge=false is then an error naming the key): mixture-of-experts models (SGLang's
expert adapters are not wired here) and multi-latent attention.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.model_args import ModelArgs
from megatron_rl.models.lora import LoraSpec
from megatron_rl.parallel import ParallelState

ADAPTER = "megatron_rl_policy"
"""The engine-side name of the actor's adapter (SGLang's ``lora_name``; every request's ``lora_path``)."""


def unsupported(args: ModelArgs) -> str | None:
    """Why the engines here cannot take ``args``' adapters unmerged, or None."""
    if args.mla is not None:
        return "adapters of multi-latent attention reach the engine merged here"
    if args.is_moe:
        return "adapters of mixture-of-experts models reach the engine merged here"
    return None


def refusal(why: str) -> str:
    """The one-line error of ``lora.merge=false`` where it cannot be honoured."""
    return f"actor_rollout_ref.model.lora.merge=false: {why}; set it to true (the default)."


def unmerged(model: Any, engine: Any) -> bool:
    """Whether this sync sends the adapters apart from the base (module docstring)."""
    spec = getattr(model, "lora", None)
    if spec is None or spec.merge:
        return False
    why = unsupported(model.args)
    if why is None and not getattr(engine, "takes_adapters", False):
        why = f"the rollout engine ({type(engine).__name__}) was not started with LoRA support"
    if why is not None:
        raise ValueError(refusal(why))
    return True


def sync_adapters(
    inner: Any, ps: ParallelState, engine: Any, dtype: torch.dtype | None, stream: Callable[[], dict]
) -> dict[str, float]:
    """Collective: the unmerged sync of the actor ``inner`` (the megatron module; module docstring),
    with reshard.sync_weights' statistics (bytes, buckets, seconds, check_seconds; adapter_bytes: the
    adapters' share). ``stream()``: the weight stream (reshard.stream_weights), run with the adapters
    off when the engine lacks the base."""
    from megatron_rl.models.lora import adapters_disabled
    from megatron_rl.models.lora_files import gather_peft, peft_config

    start = time.perf_counter()
    stats = {"bytes": 0.0, "buckets": 0.0, "check_seconds": 0.0}
    if not getattr(engine, "adapter_base", False):
        with adapters_disabled(inner):
            stats = stream()
        engine.adapter_base = True
    dtype = dtype or engine.dtype
    tensors = gather_peft(inner, ps)
    if ps.pp_size > 1:  # every stage's adapters (a few MB: objects over the pipeline group)
        parts: list[Any] = [None] * ps.pp_size
        dist.all_gather_object(parts, {k: v.cpu() for k, v in tensors.items()}, group=ps.pp_group)
        tensors = {k: v.to(ps.device) for part in parts for k, v in part.items()}
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    targets = sorted({k.split(".")[-3] for k in tensors})  # q_proj, ..., down_proj
    spec: LoraSpec = inner.lora
    engine.load_adapters(tensors, peft_config(spec, targets, spec.base))
    if ps.device.type == "cuda":
        torch.cuda.synchronize()
    adapter_bytes = float(sum(t.numel() * t.element_size() for t in tensors.values()))
    stats["adapter_bytes"] = adapter_bytes
    stats["bytes"] += adapter_bytes
    stats["seconds"] = time.perf_counter() - start
    return stats
