"""LoRA adapters beside megatron-core's tensor-parallel linears, sharded as the linear is.

    add_adapters(model, spec, ps, key)   after the weights load, before DDP wraps the model: the base
                                         is frozen; one LoRAAdapter per target linear
    y = W x + (alpha / r) * B A dropout(x)

A column-parallel linear W [out/TP, in] (``linear_qkv``, ``linear_fc1``) gets A [r, in] replicated and
B [out/TP, r] split by rows like W; a row-parallel one W [out, in/TP] (``linear_proj``, ``linear_fc2``)
gets A [r, in/TP] split by columns like W and B [out, r] replicated. The r-wide activation between A
and B is where TP communicates, as megatron does around W:

    column  h = A x (same on every rank)   -> copy-to-TP (backward: all-reduce of B's partial grads)
    row     h = A_r x_r (a partial sum)     -> all-reduce over TP (forward)
    sequence parallel: the all-gather / reduce-scatter along the sequence instead, and the replicated
    factor (A or B) sees 1/TP of the tokens: marked ``sequence_parallel``, its gradient is summed over TP
    by megatron's finalize_model_grads, as a norm's is.

An adapter is a sibling of its linear (``self_attention.linear_qkv_lora.{A,B}``), so the base keeps its
names (the weight tables, loading, the stream) and the adapter its own sharded checkpoint entries. A
fused linear takes one adapter: ``linear_qkv``'s B rows follow W's group-major [q_g | k_g | v_g] rows and
``linear_fc1``'s W's [gate_r; up_r]; exported to PEFT (:func:`peft_tensors`) they become one adapter
per HF projection, sharing A. ``adapters_disabled(model)``: the base model (the reference policy for
free); ``merged_params(model)``: W + scale * B @ A, what the rollout engine receives.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_rl import seeds
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.lora import LINEARS, LoraConfig, lora_targets
from megatron_rl.models.chunks import chunks_of, last_chunk
from megatron_rl.parallel import ParallelState

SUFFIX = "_lora"
"""An adapter's module name: its linear's name + SUFFIX (``linear_qkv_lora``)."""


@dataclass(frozen=True)
class LoraSpec:
    """What a model's adapters are (kept on the model as ``model.lora``; checkpoints record it)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: str
    """The base model's path (the checkpoint holds the adapters, not the base)."""
    merge: bool = True
    """``lora.merge``: how the rollout engine gets the adapters (rollout.lora_sync); recorded, not
    compared on resume."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def mark(p: torch.Tensor, **marks: object) -> None:
    """Set megatron's parameter marks (``tensor_model_parallel``, ``partition_dim``,
    ``sequence_parallel``, ``allreduce``, ...), which its DDP, grad norm and finalize_model_grads read."""
    for k, v in marks.items():
        setattr(p, k, v)


def init_a(rank: int, fan_in: int, init: str, seed: int) -> torch.Tensor:
    """A [r, in] (fp32): uniform with xavier's or kaiming's bound, from a stream seeded by the adapted
    matrix's global name (``seed``), so that no layout changes it."""
    gen = torch.Generator().manual_seed(seed)
    bound = math.sqrt(6.0 / (fan_in + rank)) if init == "xavier" else 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float32) * 2 - 1) * bound


class LoRAAdapter(nn.Module):
    """One linear's adapter (module docstring); ``parallel``: "column", "row" or "duplicated" (W whole
    on every TP rank: multi-latent attention's down projections, models.mla.DuplicatedLinear)."""

    def __init__(
        self,
        linear: Any,
        parallel: str,
        rank: int,
        scale: float,
        dropout: float,
        init: str,
        tp_rank: int,
        tp_size: int,
        seed: int,
        gated: bool,
    ) -> None:
        super().__init__()
        w = linear.weight  # column: [out/TP, in]; row: [out, in/TP]
        out_local, in_local = w.shape
        self.parallel, self.scale, self.gated = parallel, scale, gated
        self.tp_group = linear.tp_group
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        in_full = in_local * (tp_size if parallel == "row" else 1)
        # A over the full [r, in] matrix, then this rank's columns: the same adapter at every TP size
        a_full = init_a(rank, in_full, init, seed)
        if parallel == "row":
            a_full = a_full[:, tp_rank * in_local : (tp_rank + 1) * in_local]
        self.A = nn.Parameter(a_full.to(device=w.device, dtype=w.dtype).contiguous())
        self.B = nn.Parameter(torch.zeros(out_local, rank, device=w.device, dtype=w.dtype))
        # the replicated factor sees 1/TP of the tokens under sequence parallelism (module docstring)
        if parallel == "duplicated":  # W whole on every rank: so are A and B
            for p in (self.A, self.B):
                mark(p, tensor_model_parallel=False, sequence_parallel=self.sequence_parallel)
        else:
            split, whole = (self.B, self.A) if parallel == "column" else (self.A, self.B)
            mark(split, tensor_model_parallel=tp_size > 1, partition_dim=int(parallel == "row"))
            mark(whole, tensor_model_parallel=False, sequence_parallel=self.sequence_parallel)
        for p in (self.A, self.B):
            mark(p, partition_stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the linear's input -> the adapter's share of its output (same shape as W x)."""
        from megatron.core.tensor_parallel import mappings as tpm

        if torch.is_grad_enabled():  # training passes; log-prob passes run without dropout
            x = self.dropout(x)
        h = nn.functional.linear(x, self.A)  # [s(/TP), b, r]
        if self.parallel == "duplicated":
            pass  # this rank's tokens, whole matrices: nothing to exchange
        elif self.parallel == "column":
            if self.sequence_parallel:
                h = tpm.gather_from_sequence_parallel_region(h, group=self.tp_group)  # [s, b, r]
            else:
                h = tpm.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = tpm.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)  # [s/TP, b, r]
        else:
            h = tpm.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return nn.functional.linear(h, self.B) * self.scale

    def delta(self) -> torch.Tensor:
        """scale * B @ A in W's shard layout and dtype (computed in fp32)."""
        return (self.B.float() @ self.A.float() * self.scale).to(self.A.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """A and B as megatron checkpoint entries, split along W's TP dimension; ``linear_fc1``'s B
        as megatron saves the fc1 weight ([gate; up], any TP loads it)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"column": {"B": 0}, "row": {"A": 1}, "duplicated": {}}[self.parallel]
        out = make_sharded_tensors_for_checkpoint({"A": self.A, "B": self.B}, prefix, axis, sharded_offsets)
        if self.gated:
            out[f"{prefix}B"] = apply_swiglu_sharded_factory(out[f"{prefix}B"], sharded_offsets)
        return out


class ExpertAdapters(nn.Module):
    """LoRA on each routed expert of a GroupedExperts (expert TP 1): fc1 W1[e] [2F, H] with A1[e] [r, H]
    and B1[e] [2F, r] ([gate; up] rows, as W1's), fc2 W2[e] [H, F] with A2[e] [r, F] and B2[e] [H, r];
    each expert's rows take its own adapter through the same grouped matmuls as the weights. Reduced
    over the expert-data-parallel group, as the experts' weights (``allreduce``)."""

    def __init__(
        self,
        experts: Any,
        targets: tuple[str, ...],
        rank: int,
        scale: float,
        dropout: float,
        init: str,
        seeds: list[tuple[int, int]],
    ) -> None:
        """``seeds``: (fc1, fc2) seed of each local expert, from its global name."""
        super().__init__()
        self.scale, self.enabled = scale, True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        w1, w2 = experts.weight1, experts.weight2  # [E, 2F, H], [E, H, F]
        self.local_experts = experts.num_local_experts
        self.fc1 = "linear_fc1" in targets
        self.fc2 = "linear_fc2" in targets
        for which, w, on in ((1, w1, self.fc1), (2, w2, self.fc2)):
            if not on:
                continue
            e, rows, cols = w.shape
            a = torch.stack([init_a(rank, cols, init, sd[which - 1]) for sd in seeds])
            A = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
            B = nn.Parameter(torch.zeros(e, rows, rank, device=w.device, dtype=w.dtype))
            for p in (A, B):
                mark(p, allreduce=w.allreduce)  # reduced over the expert-data-parallel group
            setattr(self, f"A{which}", A)
            setattr(self, f"B{which}", B)

    def forward(self, x: torch.Tensor, offs: torch.Tensor, which: int) -> torch.Tensor | None:
        """x [N, in] sorted by local expert -> the adapters' share of projection ``which`` [N, out], or
        None (switched off, or no adapter on that projection)."""
        from megatron_rl.models.experts import _grouped_mm

        if not self.enabled or not (self.fc1 if which == 1 else self.fc2):
            return None
        A, B = getattr(self, f"A{which}"), getattr(self, f"B{which}")
        if torch.is_grad_enabled():
            x = self.dropout(x)
        h = _grouped_mm(x, A.transpose(1, 2), offs)  # [N, r]
        return _grouped_mm(h, B.transpose(1, 2), offs) * self.scale

    def delta(self, which: int, j: int) -> torch.Tensor:
        """scale * B[j] @ A[j] of local expert ``j``'s projection ``which`` (W's layout and dtype)."""
        A, B = getattr(self, f"A{which}")[j], getattr(self, f"B{which}")[j]
        return (B.float() @ A.float() * self.scale).to(A.dtype)


def _hook(adapter: LoRAAdapter):
    def add(module: nn.Module, args: tuple, kwargs: dict, output):
        if not adapter.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapter(x), bias

    return add


def add_adapters(model: Any, spec: LoraConfig, ps: ParallelState, key: str, base: str, seed: int) -> None:
    """Freeze ``model`` and add ``spec``'s adapters (module docstring); a critic's value head stays
    trained. ``key``: the config section (error lines); ``base``: the model's path (recorded)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_rl.models.experts import GroupedExperts
    from megatron_rl.models.mla import DuplicatedLinear
    from megatron_rl.weights.tables import global_layer_name

    targets = lora_targets(spec, key)
    if getattr(model, "transformer_impl", "local") != "local":
        from megatron_rl.models.te_spec import KEY

        raise ConfigError(
            f"{key}.rank={spec.rank}: LoRA on Transformer Engine's layers is not implemented: set {KEY}=local"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    if model.role == "critic" and ps.is_last_stage:
        for p in last_chunk(model).output_layer.parameters():
            p.requires_grad_(True)
    linears = (ColumnParallelLinear, RowParallelLinear, DuplicatedLinear)
    added, found = 0, set[str]()
    # every model chunk of an interleaved pipeline: names (seeds, targets, files) are global
    modules = [(chunk, name, m) for chunk in chunks_of(model) for name, m in list(chunk.named_modules())]
    for chunk, name, module in modules:
        if isinstance(module, GroupedExperts):
            n = _add_expert_adapters(chunk, name, module, spec, ps, key, targets, seed)
            added += n
            found |= {"routed experts"} if n else set()
            continue
        leaf = name.rsplit(".", 1)[-1]
        full = global_layer_name(name, chunk.layer_offset)
        if not isinstance(module, linears) or not _named(targets, leaf, full):
            continue
        if ".experts.local_experts." in name:
            raise ValueError(
                f"{key}: adapters on routed experts need grouped experts: set "
                "*.megatron.override_transformer_config.moe_grouped_gemm=true (the default)."
            )
        if _named(spec.exclude_modules, leaf, full):
            continue
        parallel = {ColumnParallelLinear: "column", RowParallelLinear: "row"}.get(type(module), "duplicated")
        adapter = LoRAAdapter(
            module,
            parallel,
            spec.rank,
            spec.alpha / spec.rank,
            spec.dropout,
            spec.lora_A_init_method,
            ps.tp_rank,
            ps.tp_size,
            seed=seeds.derive(seeds.LORA_INIT, seed, key, full),
            gated=leaf == "linear_fc1",
        )
        parent = chunk.get_submodule(name.rsplit(".", 1)[0])
        parent.add_module(leaf + SUFFIX, adapter)
        module.register_forward_hook(_hook(adapter), with_kwargs=True)
        added += 1
        found.add(leaf)
    if ps.rank == 0:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(
            f"megatron-rl: LoRA on the {model.role}: rank {spec.rank}, alpha {spec.alpha:g} on "
            f"{', '.join(sorted(found))} ({added} linears of this stage); {trained:,} of {total:,} "
            "parameters of rank 0 train, the base is frozen",
            flush=True,
        )
    if not added:
        raise ValueError(f"{key}.exclude_modules={spec.exclude_modules} leaves no linear for an adapter")
    model.lora = LoraSpec(spec.rank, spec.alpha, targets, base, spec.merge)


def _named(names, leaf: str, full: str) -> bool:
    """Whether ``target_modules`` / ``exclude_modules`` name a module: by its leaf name
    (``linear_qkv``) or by an fnmatch pattern over its global name (``decoder.layers.0.*``)."""
    return any(p == leaf or fnmatch.fnmatchcase(full, p) for p in names)


def _add_expert_adapters(
    model: Any, name: str, experts: Any, spec: LoraConfig, ps: ParallelState, key: str, targets, seed: int
) -> int:
    """Adapters on one GroupedExperts' local experts (``name``: its module name in ``model``, a model
    chunk); how many linears."""
    from megatron_rl.weights.tables import global_expert_name, global_layer_name

    wanted = tuple(t for t in ("linear_fc1", "linear_fc2") if t in targets)
    prefix = global_layer_name(name, model.layer_offset)  # decoder.layers.{i}.mlp.experts
    wanted = tuple(t for t in wanted if not _named(spec.exclude_modules, t, prefix))
    if not wanted:
        return 0
    if ps.etp_size > 1:
        raise ValueError(
            f"{key}: adapters on routed experts need expert_tensor_parallel_size=1; set "
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 (or "
            f"{key}.exclude_modules=['*.experts'])."
        )
    streams = []
    for j in range(experts.num_local_experts):
        g = global_expert_name(f"{prefix}.local_experts.{j}", model.expert_offset)
        fc1, fc2 = (
            seeds.derive(seeds.LORA_INIT, seed, key, f"{g}.{fc}") for fc in ("linear_fc1", "linear_fc2")
        )
        streams.append((fc1, fc2))
    scale = spec.alpha / spec.rank
    experts.add_module(
        "lora",
        ExpertAdapters(experts, wanted, spec.rank, scale, spec.dropout, spec.lora_A_init_method, streams),
    )
    return len(wanted) * experts.num_local_experts


def adapters(model: Any) -> Iterator[tuple[str, LoRAAdapter]]:
    """(the adapted linear's global name, ``decoder.layers.{i}.self_attention.linear_qkv``, its adapter)
    for every adapter of ``model`` (of each of its model chunks)."""
    for name, module in _global_modules(model, LoRAAdapter):
        yield name.removesuffix(SUFFIX), module


def expert_adapters(model: Any) -> Iterator[tuple[str, ExpertAdapters]]:
    """(the global name of the experts, ``decoder.layers.{i}.mlp.experts``, their adapters) for every
    grouped-experts module of ``model`` that has them."""
    for name, module in _global_modules(model, ExpertAdapters):
        yield name.removesuffix(".lora"), module


def _global_modules(model: Any, kind: type) -> Iterator[tuple[str, Any]]:
    """(global name, module) of every ``kind`` module in the model chunks of ``model``."""
    from megatron_rl.weights.tables import global_layer_name

    for chunk in chunks_of(model):
        for name, module in chunk.named_modules():
            if isinstance(module, kind):
                yield global_layer_name(name, chunk.layer_offset), module


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...linear_qkv_lora.A``)."""
    return name.endswith((f"{SUFFIX}.A", f"{SUFFIX}.B"))


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """Run ``model`` as its base (the reference policy of a LoRA actor)."""
    found: list[Any] = [a for _, a in adapters(model)]
    found += [m for m in model.modules() if isinstance(m, ExpertAdapters)]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


class MergedParams(Mapping):
    """``named_global_params(model)`` with every adapted weight replaced by W + scale * B @ A, computed
    when read (one weight at a time: never a second copy of the model). Adapters switched off
    (:func:`adapters_disabled`) are left out: the base's weights as they are."""

    def __init__(self, model: Any, params: dict[str, torch.Tensor]) -> None:
        from megatron_rl.weights.tables import global_expert_name

        self.params = params
        self.deltas: dict[str, Callable[[], torch.Tensor]] = {
            f"{name}.weight": a.delta for name, a in adapters(model) if a.enabled
        }
        for experts, module in expert_adapters(model):  # each expert's fc1 / fc2
            if module.enabled:
                for j in range(module.local_experts):
                    for which, on in ((1, module.fc1), (2, module.fc2)):
                        local = f"{experts}.local_experts.{j}.linear_fc{which}.weight"
                        if on:
                            g = global_expert_name(local, model.expert_offset)
                            self.deltas[g] = functools.partial(module.delta, which, j)

    @property
    def experts_adapted(self) -> bool:
        return any(".local_experts." in n for n in self.deltas)

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.params[name]
        delta = self.deltas.get(name)
        return w if delta is None else w + delta()

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def merged_params(model: Any, params: dict[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``params`` (named_global_params), adapters merged (:class:`MergedParams`) when the model has any."""
    return MergedParams(model, params) if getattr(model, "lora", None) is not None else params


__all__ = ["LINEARS", "LoRAAdapter", "LoraSpec", "add_adapters", "adapters_disabled", "merged_params"]
