"""A weight bucket into SGLang's model, routed experts copied straight into the fused expert weights.

Runs in SGLang's worker process: the engine is started with ``custom_weight_loader=[LOADER]`` and
each bucket goes to ``update_weights_from_tensor`` with ``load_format=LOADER`` as ONE named tensor,
the bucket's flat buffer (shared through a CUDA IPC handle), whose name is the JSON header
:func:`bucket_header` writes: the offset and shape of every tensor, with a layer's routed experts as
stacked runs (:class:`~megatron_rl.rollout.reshard.ExpertStack`) rather than one entry per expert.
With the engine's expert parallelism (rollout.expert_parallel_size) each engine rank's header names
only the routed experts that rank holds (:func:`engine_expert_block`), so its worker reads no other.

:func:`load_bucket` copies a stacked run into ``FusedMoE.w13_weight`` / ``w2_weight`` (the slice of
this engine rank's expert TP shard, at this rank's block of experts) with one copy per projection,
when :func:`fused_experts` finds the layout it writes: unquantized, gated, not transposed, padded or
pre-sharded, gate before up, no fused shared experts, shapes as expected. Anything else (and every
other tensor) goes through the model's own ``load_weights`` under the per-expert checkpoint names: the
per-expert loader is the fallback the check selects, and both write the same bytes.

:func:`read_back` is the engine's half of the sync check (rollout.checksums): for every streamed
tensor it finds where this engine rank holds its piece (a fused ``qkv_proj`` / ``gate_up_proj`` slice,
a vocabulary or tensor-parallel shard, a fused expert slice, or a replicated copy counted on rank 0
only) and writes that piece's share of the tensor's checksum into a buffer the trainer shares with it;
the shares of an engine group add up to the checksum of the whole tensor as the engine holds it. An
expert counts on its EP rank; a shard that every attention group holds (DP attention) counts 1/D on
each of the D groups, so that a wrong copy on any of them is seen.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

import torch

LOADER = "megatron_rl.rollout.sglang_loader.load_bucket"
"""The dotted path SGLang imports (server argument ``custom_weight_loader``, and the load format)."""
READ_BACK = "megatron_rl.rollout.sglang_loader.read_back"
"""The same for :func:`read_back`, which loads nothing."""

logger = logging.getLogger(__name__)
_reported: set[str] = set()  # the path each projection took, logged once per process


def engine_expert_block(engine_rank: int, engine_ranks: int, ep: int, num_experts: int) -> range:
    """The routed experts SGLang's engine rank ``engine_rank`` (of ``engine_ranks``) holds at expert
    parallelism ``ep``: a contiguous block of num_experts / ep, its EP rank's (engine_rank // (R / ep));
    the R / ep ranks of an EP rank cut each of them by expert TP (moe_tp_rank = engine_rank % (R / ep)).
    SGLang's trivial expert placement, the one it starts with when no redundant experts are asked for."""
    if ep < 1 or engine_ranks % ep or num_experts % ep:
        raise ValueError(
            f"expert parallelism {ep} must divide the {engine_ranks} ranks and {num_experts} experts"
        )
    per, ep_rank = num_experts // ep, engine_rank // (engine_ranks // ep)
    return range(ep_rank * per, (ep_rank + 1) * per)


_ROUTED = re.compile(r"\.experts\.(\d+)\.")  # mlp.experts.{e}. / block_sparse_moe.experts.{e}.


def bucket_header(bucket, experts: range | None = None) -> str:
    """JSON: ``tensors`` [[name, shape, offset]] for the tensors outside expert stacks, ``stacks``
    [[layer, proj, first, shape, offset, names]]; offsets in elements of ``bucket.flat``. ``experts``:
    the routed experts the receiving engine rank holds (:func:`engine_expert_block`; None: all); the
    others are left out, stacks cut to the block, and ``block`` [start, stop] says which it is."""
    flat = bucket.flat
    base, size = flat.data_ptr(), flat.element_size()

    def offset(t: torch.Tensor) -> int:
        return (t.data_ptr() - base) // size

    stacks = getattr(bucket, "stacks", [])
    covered = {n for st, _ in stacks for n in st.names}

    def entry(n: str, t: torch.Tensor) -> list:  # a float32 tensor in a narrower buffer says so
        return [n, list(t.shape), offset(t)] + ([str(t.dtype)] if t.dtype != flat.dtype else [])

    def held(n: str) -> bool:
        m = _ROUTED.search(n)
        return experts is None or m is None or int(m[1]) in experts

    def stack_entry(st, v: torch.Tensor) -> list | None:
        n = st.shape[0]
        block = range(st.first, st.first + n) if experts is None else experts
        lo, hi = max(st.first, block.start), min(st.first + n, block.stop)
        if lo >= hi:
            return None
        per = len(st.names) // n  # checkpoint names per expert: gate and up (w13), or down (w2)
        skip = lo - st.first
        return [
            st.layer,
            st.proj,
            lo,
            [hi - lo, *st.shape[1:]],
            offset(v[skip:]),
            list(st.names[skip * per : (hi - st.first) * per]),
        ]

    kept = [stack_entry(st, v) for st, v in stacks]
    return json.dumps(
        {
            "tensors": [entry(n, t) for n, t in bucket if n not in covered and held(n)],
            "stacks": [s for s in kept if s is not None],
            "block": None if experts is None else [experts.start, experts.stop],
        }
    )


def _view(flat: torch.Tensor, offset: int, shape: list[int], dtype: str | None = None) -> torch.Tensor:
    """The tensor at ``offset`` (in elements of ``flat``); ``dtype`` ("torch.float32") when it is wider
    than the buffer's."""
    if dtype is None:
        return flat[offset : offset + math.prod(shape)].view(shape)
    wide = getattr(torch, dtype.removeprefix("torch."))
    span = wide.itemsize // flat.element_size() * math.prod(shape)
    return flat[offset : offset + span].view(wide).view(shape)


def load_bucket(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: ``named_tensors`` is ``[(header, flat)]``."""
    ((header, flat),) = named_tensors
    h = json.loads(header)
    rest = [(t[0], _view(flat, t[2], t[1], *t[3:])) for t in h["tensors"]]
    block = h.get("block")
    for layer, proj, first, shape, off, names in h["stacks"]:
        stack = _view(flat, off, shape)
        experts = fused_experts(model, layer, proj, first, stack, None if block is None else range(*block))
        _report(proj, experts is not None)
        if experts is None:
            rest += unstack(proj, stack, names)
        else:
            copy_stack(experts, proj, first, stack)
    if rest:
        model.load_weights(rest)
    refresh_cached_copies(model, [name for name, _ in rest])


def refresh_cached_copies(model: Any, names: list[str]) -> None:
    """Derived copies SGLang keeps of a weight, made again from it in place (a CUDA graph captured the
    copy's memory): GLM-4.5's router caches its weight in fp32 (``MoEGate._weight_fp32``) at its first
    forward and never reads the weight again."""
    for name in names:
        if not name.endswith(".mlp.gate.weight"):
            continue
        try:
            gate = _module_of(model, name)
        except AttributeError:
            continue
        cached = getattr(gate, "_weight_fp32", None)
        if isinstance(cached, torch.Tensor):
            cached.copy_(gate.weight.data)


def unstack(proj: str, stack: torch.Tensor, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """A stacked run back into per-expert checkpoint tensors (views): w13 [n, 2F, H] -> gate_e, up_e."""
    if proj == "w2":
        return list(zip(names, stack.unbind(0), strict=True))
    f = stack.shape[1] // 2
    parts = [t for e in stack.unbind(0) for t in (e[:f], e[f:])]
    return list(zip(names, parts, strict=True))


def fused_experts(
    model: Any, layer: int, proj: str, first: int, stack: torch.Tensor, block: range | None = None
) -> Any | None:
    """The layer's FusedMoE if a stacked run can be copied into its weights as-is, else None.
    ``block``: the experts the trainer streamed for this rank (:func:`engine_expert_block`), which must
    be the ones its weights hold (SGLang placed no redundant experts; None: every expert, EP 1)."""
    try:
        experts = model.model.layers[layer].mlp.experts
    except (AttributeError, IndexError, TypeError):
        return None
    if not _plain_experts(experts):
        return None
    w13: torch.Tensor = experts.w13_weight  # both tensors: _plain_experts checked them
    w2: torch.Tensor = experts.w2_weight
    tp = getattr(experts, "moe_tp_size", 0)
    n, rows, cols = stack.shape
    e_local = w13.shape[0]  # this rank's block of experts (all of them without expert parallelism)
    start = _block_start(experts)
    held = range(start, start + e_local)
    streamed = block if block is not None else (held if experts.moe_ep_size == 1 else None)
    if streamed != held:  # a block of another rank, or weights laid out otherwise (redundant experts)
        return None
    if (
        tp < 1
        or first not in held
        or first + n > held.stop
        or w2.shape[0] != e_local
        or stack.dtype != w13.dtype
    ):
        return None
    hidden, ffn = (cols, rows // 2) if proj == "w13" else (rows, cols)
    if (
        ffn % tp
        or tuple(w13.shape[1:]) != (2 * ffn // tp, hidden)
        or tuple(w2.shape[1:]) != (hidden, ffn // tp)
    ):
        return None
    return experts


def _plain_experts(experts: Any) -> bool:
    """A FusedMoE whose weights are [experts, gate + up rows of this rank's slice, hidden] and
    [experts, hidden, this rank's slice]: unquantized, gated, gate first, no transposed, padded or
    pre-sharded layout, no fused shared experts; with expert parallelism, its EP rank's block."""
    w13, w2 = getattr(experts, "w13_weight", None), getattr(experts, "w2_weight", None)
    method = getattr(experts, "quant_method", None)
    runner = getattr(experts, "moe_runner_config", None)
    return (
        isinstance(w13, torch.Tensor)
        and isinstance(w2, torch.Tensor)
        and type(method).__name__ == "UnquantizedFusedMoEMethod"
        and not getattr(method, "load_up_proj_weight_first", False)
        and bool(getattr(runner, "is_gated", False))
        and not getattr(experts, "use_triton_kernels", False)  # a transposed layout
        and not getattr(experts, "use_padded_loading", False)
        and not getattr(experts, "use_presharded_weights", False)
        and getattr(experts, "num_fused_shared_experts", 0) == 0
        and isinstance(getattr(experts, "moe_ep_size", None), int)
        and isinstance(getattr(experts, "moe_ep_rank", None), int)
    )


def _block_start(experts: Any) -> int:
    """The first global expert of this rank's block: EP rank x experts per rank (engine_expert_block)."""
    return experts.moe_ep_rank * experts.w13_weight.shape[0]


@torch.no_grad()
def copy_stack(experts: Any, proj: str, first: int, stack: torch.Tensor) -> None:
    """Experts [first, first + n) of ``stack`` into this rank's expert-TP slice of the fused weights:
    w13[e] = [gate_e rows of the slice; up_e rows of the slice], w2[e] = down_e columns of the slice
    (e local to this rank's block)."""
    n = stack.shape[0]
    first -= _block_start(experts)
    tp, r = experts.moe_tp_size, experts.moe_tp_rank
    if proj == "w13":
        f = stack.shape[1] // 2
        s = f // tp
        w = experts.w13_weight.data[first : first + n]
        w[:, :s].copy_(stack[:, r * s : (r + 1) * s])
        w[:, s:].copy_(stack[:, f + r * s : f + (r + 1) * s])
    else:
        s = stack.shape[2] // tp
        experts.w2_weight.data[first : first + n].copy_(stack[:, :, r * s : (r + 1) * s])


def _report(proj: str, direct: bool) -> None:
    if proj not in _reported:
        _reported.add(proj)
        how = "copied into the fused expert weights" if direct else "loaded expert by expert"
        logger.info("megatron-rl: %s expert weights %s", proj, how)


# -- the sync check's read-back ------------------------------------------------------------------

_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_STACKED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_STACKED |= {"q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa"}
"""DeepSeek's multi-latent attention with ``q_lora_rank``: SGLang's ``fused_qkv_a_proj_with_mqa`` holds
q_a_proj's rows, then kv_a_proj_with_mqa's, replicated on every engine rank."""
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@torch.no_grad()
def read_back(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom loader for the sync check: ``named_tensors`` is ``[(header, out)]``, the header
    JSON ``{"names": [...], "shapes": [...]}`` (checkpoint names and shapes as streamed), ``out``
    [n, CHECKSUM_SIZE + 1] float64 on this rank's GPU, shared with the trainer rank that sent it:
    row i gets this rank's share of tensor i's checksum and, in its last column, 1 if this rank knows
    where its piece of tensor i lives (0: not read back here)."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from megatron_rl.rollout.checksums import CHECKSUM_SIZE

    ((header, out),) = named_tensors
    h = json.loads(header)
    rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    params = dict(model.named_parameters())
    for i, (name, shape) in enumerate(zip(h["names"], h["shapes"], strict=True)):
        share = engine_share(model, params, name, shape, rank, ranks)
        if share is not None:
            out[i, :CHECKSUM_SIZE] = share
            out[i, CHECKSUM_SIZE] = 1.0
    torch.cuda.synchronize()  # the trainer reads ``out`` once the request returns


def engine_share(
    model: Any, params: dict, name: str, shape: list[int], rank: int, ranks: int = 1
) -> torch.Tensor | None:
    """This engine rank's (``rank`` of ``ranks``) share of the checksum of checkpoint tensor ``name``
    (``shape``) as the engine holds it (rollout.checksums.box_checksum), or None where its layout is not
    one read here."""
    from megatron_rl.rollout.checksums import CHECKSUM_SIZE, box_checksum

    cols = shape[1] if len(shape) == 2 else 1
    if len(shape) > 2:
        return None
    if m := _EXPERT.match(name):
        return _expert_share(model, int(m[1]), int(m[2]), m[3], cols)
    parts = name.split(".")
    fused = next((p for p in parts if p in _STACKED), None)
    target = name.replace(f".{fused}.", f".{_STACKED[fused]}.") if fused else name
    if fused == "kv_a_proj_with_mqa" and target not in params:  # no q_lora_rank: not fused
        fused, target = None, name
    param = params.get(target)
    if param is None:
        return None
    module = _module_of(model, target)
    data = param.data
    kind = type(module).__name__
    # a layer sharded over fewer ranks than the engine's (DP attention: attention and embeddings over
    # each group of rollout TP ranks) is held whole by each of ranks / tp_size groups: each counts 1/copies
    group = getattr(module, "tp_size", None)
    copies = ranks // group if isinstance(group, int) and 0 < group < ranks and not ranks % group else 1
    share = _sharded_share(module, kind, fused, data, name, shape, cols)
    if share is not None:
        return share / copies
    if fused in ("q_a_proj", "kv_a_proj_with_mqa") and len(shape) == 2 and data.shape[1] == cols:
        if rank:  # replicated: rank 0 counts
            return torch.zeros(CHECKSUM_SIZE, dtype=torch.float64, device=data.device)
        off = 0 if fused == "q_a_proj" else data.shape[0] - shape[0]
        return box_checksum(data.narrow(0, off, shape[0]), cols)
    if fused:
        return None
    if list(data.shape) == list(shape):  # replicated on every rank (norms, routers, row-parallel biases)
        if rank:
            return torch.zeros(CHECKSUM_SIZE, dtype=torch.float64, device=data.device)
        return box_checksum(data, cols)
    return None


def _sharded_share(
    module: Any, kind: str, fused: str | None, data: torch.Tensor, name: str, shape: list[int], cols: int
) -> torch.Tensor | None:
    """The share of this rank's shard of a tensor-parallel layer (its place from the layer's own tp_rank
    within the group it is sharded over), or None for a layer that is not one."""
    from megatron_rl.rollout.checksums import CHECKSUM_SIZE, box_checksum

    if fused in ("q_proj", "k_proj", "v_proj") and hasattr(module, "num_kv_head_replicas"):
        q, kv = module.q_proj_shard_size, module.kv_proj_shard_size
        off, size = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, module.v_proj_shard_size)}[fused]
        if fused == "q_proj":
            row0 = module.tp_rank * size
        else:  # with fewer KV heads than ranks, ranks hold replicas: the first of each counts
            if module.tp_rank % module.num_kv_head_replicas:
                return torch.zeros(CHECKSUM_SIZE, dtype=torch.float64, device=data.device)
            row0 = module.tp_rank // module.num_kv_head_replicas * size
        return box_checksum(data.narrow(0, off, size), cols, row0=row0)
    if fused in ("gate_proj", "up_proj") and hasattr(module, "output_sizes"):
        size = module.output_sizes[0] // module.tp_size
        off = 0 if fused == "gate_proj" else size
        return box_checksum(data.narrow(0, off, size), cols, row0=module.tp_rank * size)
    if fused:
        return None
    if hasattr(module, "shard_indices"):  # a vocabulary-parallel embedding or LM head (padded rows last)
        si = module.shard_indices
        n = si.org_vocab_end_index - si.org_vocab_start_index
        return box_checksum(data[:n], cols, row0=si.org_vocab_start_index)
    if kind == "RowParallelLinear" and name.endswith(".weight"):
        per = module.input_size_per_partition
        return box_checksum(data, cols, col0=module.tp_rank * per)
    if kind == "ColumnParallelLinear":
        per = data.shape[0]
        return box_checksum(data, cols, row0=module.tp_rank * per)
    return None


def _module_of(model: Any, param_name: str) -> Any:
    """The layer holding ``param_name``; under SGLang's LoRA wrapper (enable_lora), the wrapped layer."""
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    return getattr(module, "base_layer", module)


def _expert_share(model: Any, layer: int, expert: int, proj: str, cols: int) -> torch.Tensor | None:
    """Expert ``expert``'s gate/up rows (w13) or down columns (w2) of this rank's expert-TP slice; zero
    for an expert of another EP rank's block."""
    from megatron_rl.rollout.checksums import CHECKSUM_SIZE, box_checksum

    try:
        experts = model.model.layers[layer].mlp.experts
    except (AttributeError, IndexError, TypeError):
        return None
    if not _plain_experts(experts):
        return None
    expert -= _block_start(experts)
    if not 0 <= expert < experts.w13_weight.shape[0]:  # held by another EP rank
        return torch.zeros(CHECKSUM_SIZE, dtype=torch.float64, device=experts.w13_weight.device)
    r = experts.moe_tp_rank
    if proj == "down_proj":
        w = experts.w2_weight.data[expert]  # [hidden, ffn / tp]
        return box_checksum(w, cols, col0=r * w.shape[1])
    s = experts.w13_weight.shape[1] // 2
    w = experts.w13_weight.data[expert, :s] if proj == "gate_proj" else experts.w13_weight.data[expert, s:]
    return box_checksum(w, cols, row0=r * s)
