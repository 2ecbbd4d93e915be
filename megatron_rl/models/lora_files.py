"""LoRA adapters in files: PEFT's adapter format (``adapter_model.safetensors``: one adapter per HF
projection, ``base_model.model.<module>.lora_{A,B}.weight``) in and out, and a trainer checkpoint's
adapters read without the model (ckpt_tools export-peft).

    peft_tensors(args, adapters)      full (TP=1) adapters of megatron's linears -> PEFT's tensors
    load_peft / fill_from_peft        PEFT's tensors -> this rank's shard of every adapter
    gather_peft(model, ps)            this stage's adapter shards -> full PEFT tensors (rollout.lora_sync)
    read_adapters(path)               a LoRA torch_dist checkpoint -> its spec, linears' and experts' adapters
    hf_deltas(...)                    scale * B @ A of every adapted HF weight (an export with --merged)
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_rl.models.lora import SUFFIX, ExpertAdapters, LoraSpec, adapters
from megatron_rl.parallel import ParallelState


def peft_tensors(model_args, adapters_by_name: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """PEFT's tensors (``base_model.model.<hf module>.lora_{A,B}.weight``) from full (TP=1) adapters
    {megatron global linear name (``decoder.layers.3.self_attention.linear_qkv``): (A, B)}: a fused
    linear's B rows go to the HF projections its weight's rows come from (the TP=1 weight table), each
    with the shared A; a row-parallel linear's A columns likewise."""
    from megatron_rl.weights.tables import param_layouts

    layouts = {lay.name: lay for lay in param_layouts(model_args, 1)}
    out: dict[str, torch.Tensor] = {}
    for name, (a, b) in adapters_by_name.items():
        lay = layouts[f"{name}.weight"]
        if lay.dim is None:  # a whole matrix (one piece): its adapter as it is
            key = f"base_model.model.{lay.pieces[0][0].hf_name.removesuffix('.weight')}"
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a.clone(), b.clone()
            continue
        offset = 0
        pieces = lay.pieces[0]
        parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for pc in pieces:
            n = pc.stop - pc.start
            src = b if lay.dim == 0 else a
            block = src[offset : offset + n] if lay.dim == 0 else src[:, offset : offset + n]
            parts.setdefault(pc.hf_name.removesuffix(".weight"), []).append((pc.start, block))
            offset += n
        for module, blocks in parts.items():
            blocks.sort(key=lambda x: x[0])
            joined = torch.cat([blk for _, blk in blocks], dim=0 if lay.dim == 0 else 1)
            key = f"base_model.model.{module}"
            # clones: each its own storage (safetensors refuses shared ones)
            out[f"{key}.lora_A.weight"] = (a if lay.dim == 0 else joined).clone()
            out[f"{key}.lora_B.weight"] = (joined if lay.dim == 0 else b).clone()
    return out


@torch.no_grad()
def load_peft(model: Any, path: str, ps: ParallelState, key: str) -> None:
    """Fill ``model``'s adapters from a PEFT LoRA directory (adapter_config.json and
    adapter_model.safetensors, e.g. from ckpt_tools export-peft): this rank's shard of each, the
    inverse of :func:`peft_tensors`. The rank and alpha must be the model's."""
    import json
    import os

    from safetensors.torch import load_file

    files = [os.path.join(path, f) for f in ("adapter_config.json", "adapter_model.safetensors")]
    if not all(os.path.isfile(f) for f in files):
        raise FileNotFoundError(
            f"{key}={path}: a PEFT adapter directory holds adapter_config.json and adapter_model.safetensors "
            "(ckpt_tools export-peft writes one)."
        )
    with open(files[0]) as f:
        saved = json.load(f)
    spec: LoraSpec = model.lora
    if (saved.get("r"), float(saved.get("lora_alpha", 0))) != (spec.rank, float(spec.alpha)):
        raise ValueError(
            f"{key}={path}: its adapters have r={saved.get('r')}, lora_alpha={saved.get('lora_alpha')}; set "
            f"{key.rsplit('.', 1)[0]}.rank / .alpha to them."
        )
    if any(isinstance(m, ExpertAdapters) for m in model.modules()):
        raise ValueError(
            f"{key}={path}: PEFT directories hold no adapters of routed experts here: leave it unset, "
            "or exclude the experts (exclude_modules=['*.experts'])."
        )
    fill_from_peft(model, load_file(files[1]), ps, f"{key}={path}")


@torch.no_grad()
def fill_from_peft(model: Any, tensors: dict[str, torch.Tensor], ps: ParallelState, where: str) -> None:
    """This rank's shard of every linear's adapter from PEFT's tensors (:func:`load_peft`); ``where``
    names the source in errors."""
    from megatron_rl.weights.tables import param_layouts

    layouts = {lay.name: lay for lay in param_layouts(model.args, ps.tp_size)}

    def get(hf_name: str, which: str) -> torch.Tensor:
        name = f"base_model.model.{hf_name.removesuffix('.weight')}.lora_{which}.weight"
        if name not in tensors:
            raise KeyError(f"{where}: no {name} (the adapters of this model's targets)")
        return tensors[name]

    for name, a in adapters(model):
        lay = layouts[f"{name}.weight"]
        pieces = lay.pieces[ps.tp_rank]
        if lay.dim == 0:  # column: B's rows from each HF projection, one A shared by them
            b = torch.cat([get(pc.hf_name, "B")[pc.start : pc.stop] for pc in pieces])
            shared = [get(pc.hf_name, "A") for pc in pieces]
            if any(not torch.equal(x, shared[0]) for x in shared):
                raise ValueError(
                    f"{where}: {name} is one fused linear here; the adapters of its HF projections "
                    f"({', '.join(sorted({pc.hf_name for pc in pieces}))}) have different A matrices"
                )
            w = shared[0]
        elif lay.dim == 1:  # row: A's columns of this shard, B whole
            w = torch.cat([get(pc.hf_name, "A")[:, pc.start : pc.stop] for pc in pieces], dim=1)
            b = get(pieces[0].hf_name, "B")
        else:  # whole on every rank
            w, b = get(pieces[0].hf_name, "A"), get(pieces[0].hf_name, "B")
        a.A.copy_(w)
        a.B.copy_(b)


@torch.no_grad()
def gather_peft(model: Any, ps: ParallelState) -> dict[str, torch.Tensor]:
    """Collective over the TP group: the full PEFT tensors (``base_model.model.<hf module>.lora_{A,B}
    .weight``) of this pipeline stage's linear adapters, the inverse of :func:`fill_from_peft`: the
    split factor (a column linear's B [out/TP, r], a row linear's A [r, in/TP]) all-gathered, each
    rank's rows / columns placed by the weight table's pieces; the whole factor shared (A of q, k and
    v; B of a row linear). In the adapters' dtype, on their device."""
    import torch.distributed as dist

    from megatron_rl.weights.tables import hf_shapes, param_layouts

    layouts = {lay.name: lay for lay in param_layouts(model.args, ps.tp_size)}
    shapes = hf_shapes(model.args)  # HF [rows, cols] of each projection
    out: dict[str, torch.Tensor] = {}
    for name, a in adapters(model):
        lay = layouts[f"{name}.weight"]
        A, B = a.A.detach(), a.B.detach()
        if lay.dim is None:  # whole on every rank
            key = f"base_model.model.{lay.pieces[0][0].hf_name.removesuffix('.weight')}"
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = A.clone(), B.clone()
            continue
        split = (B if lay.dim == 0 else A).contiguous()
        shards = [split]
        if ps.tp_size > 1:
            shards = [torch.empty_like(split) for _ in range(ps.tp_size)]
            dist.all_gather(shards, split, group=ps.tp_group)
        for r, shard in enumerate(shards):
            off = 0
            for pc in lay.pieces[r]:
                n = pc.stop - pc.start
                key = f"base_model.model.{pc.hf_name.removesuffix('.weight')}"
                rows, cols = shapes[pc.hf_name]
                if lay.dim == 0:  # column: this rank's rows of B; A shared
                    full = out.setdefault(f"{key}.lora_B.weight", B.new_empty(rows, B.shape[1]))
                    full[pc.start : pc.stop] = shard[off : off + n]
                    out.setdefault(f"{key}.lora_A.weight", A.clone())
                else:  # row: this rank's columns of A; B shared
                    full = out.setdefault(f"{key}.lora_A.weight", A.new_empty(A.shape[0], cols))
                    full[:, pc.start : pc.stop] = shard[:, off : off + n]
                    out.setdefault(f"{key}.lora_B.weight", B.clone())
                off += n
    return out


Adapters = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""{global linear name (``decoder.layers.3.self_attention.linear_qkv``): (A, B)}, full (TP=1) matrices."""
ExpertAdapterSet = dict[str, dict[str, torch.Tensor]]
"""{``decoder.layers.{i}.mlp.experts``: {"A1": [E, r, H], "B1": [E, 2F, r], "A2": [E, r, F],
"B2": [E, H, r]}}."""


def read_adapters(path: str) -> tuple[LoraSpec, Adapters, ExpertAdapterSet]:
    """A LoRA model's torch_dist checkpoint (what a trainer checkpoint's actor/ holds) -> its spec, its
    linears' adapters and its routed experts' adapters, read without building the model. Needs
    torch.distributed (a world of one)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_rl.weights.ckpt_format import read_our_metadata, resolve_torch_dist
    from megatron_rl.weights.safe_load import check_torch_dist, safe_globals

    loc = resolve_torch_dist(path)
    ours = read_our_metadata(loc) or {}
    if "lora" not in ours:
        raise ValueError(f"{path} holds no LoRA adapters (a whole model: use mcore-to-hf)")
    saved = ours["lora"]
    spec = LoraSpec(saved["rank"], saved["alpha"], tuple(saved["targets"]), saved["base"])
    meta, _ = check_torch_dist(loc.ckpt_dir)
    sharded = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and (
            key.endswith((f"{SUFFIX}.A", f"{SUFFIX}.B")) or ".lora." in key
        ):
            size, dtype = tuple(md.size), md.properties.dtype
            zero = (0,) * len(size)
            empty = torch.empty(size, dtype=dtype)
            sharded[key] = ShardedTensor(key, empty, dtype, size, size, zero, axis_fragmentations=None)
    with torch.serialization.safe_globals(safe_globals()):
        loaded = dist_checkpointing.load(sharded, loc.ckpt_dir)
    # dense layers are stacked (decoder.layers.<module> [num_layers, ...]), MoE models' layers are saved
    # one by one (decoder.layers.{i}.<module>); an expert stack is experts.experts.lora.* [E, ...]
    flat: dict[str, torch.Tensor] = {}
    for key, t in loaded.items():
        if re.match(r"decoder\.layers\.\d+\.", key) or not key.startswith("decoder.layers."):
            flat[key] = t
        else:
            rest = key.removeprefix("decoder.layers.")
            flat.update({f"decoder.layers.{i}.{rest}": t[i] for i in range(t.shape[0])})
    linears: Adapters = {}
    experts: ExpertAdapterSet = {}
    for name, t in flat.items():
        if name.endswith(f"{SUFFIX}.A"):
            linears[name.removesuffix(f"{SUFFIX}.A")] = (t, flat[name[:-1] + "B"])
        elif ".experts.experts.lora." in name:
            module, which = name.split(".experts.lora.")
            experts.setdefault(module, {})[which] = t
    return spec, linears, experts


def hf_deltas(
    model_args, spec: LoraSpec, linears: Adapters, experts: ExpertAdapterSet
) -> dict[str, torch.Tensor]:
    """scale * B @ A (fp32) of every adapted HF weight, by its HF name: what ``ckpt_tools export-peft
    --merged`` adds to the base."""
    from megatron_rl.weights.tables import TABLES, layer_index

    out: dict[str, torch.Tensor] = {}
    tensors = peft_tensors(model_args, linears)
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = spec.scale * (b.float() @ a.float())
    t, f = TABLES[model_args.arch], model_args.moe_ffn_hidden_size
    for module, ab in experts.items():
        i = layer_index(module)
        count = next(v for k, v in ab.items() if k.startswith("A")).shape[0]
        for e in range(count):
            if "A1" in ab:  # [gate; up] rows
                d = spec.scale * (ab["B1"][e].float() @ ab["A1"][e].float())
                out[t.expert_gate.format(i=i, e=e)], out[t.expert_up.format(i=i, e=e)] = d[:f], d[f:]
            if "A2" in ab:
                out[t.expert_down.format(i=i, e=e)] = spec.scale * (ab["B2"][e].float() @ ab["A2"][e].float())
    return out


def peft_config(spec: LoraSpec, target_hf: list[str], base: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_hf),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
    }
