"""HF <-> Megatron weight mapping: one table per architecture, one mechanism for every use.

Each Megatron parameter is described, for a given TP rank, as a list of :class:`Piece` s: blocks of
HF tensors (a row range, or a column range for row-parallel weights) laid one after another along
the split dimension of the Megatron shard. That single description serves

* loading an HF directory: each rank reads only its pieces (safetensors slices), never the model;
* checkpoint conversion (``ckpt_tools``) in both directions;
* live weight sync (``rollout.reshard``): after a TP gather, shard r's pieces are scattered back
  into full HF tensors.

Layouts that a plain dim-0 split would get wrong are spelled out by the pieces:

* ``linear_qkv`` is group-major: for each KV group g, [q heads of g | k_g | v_g]. A TP shard holds
  whole groups, so shard r is the list of (q_g, k_g, v_g) row blocks of its groups.
* ``linear_fc1`` is [gate; up] and a TP shard is [gate_r; up_r], not a chunk of the full tensor.
* the vocabulary is padded to a multiple of TP; padding rows exist only on the Megatron side.
* a mixture-of-experts layer (Qwen3-MoE, Mixtral) has a router [E, H] (replicated) and E experts,
  each a SwiGLU MLP laid out like the dense one (megatron's SequentialMLP). Expert parameters are
  split over the *expert* tensor-parallel group (``pieces`` has ETP entries, :attr:`ParamLayout.expert`)
  and distributed whole over the expert-parallel ranks: EP rank r holds experts [r*E/EP, (r+1)*E/EP).

Megatron names use the GLOBAL layer index (``decoder.layers.{i}``) and the GLOBAL expert index
(``mlp.experts.local_experts.{e}``); the pipeline stage's and expert rank's local indices are
translated by the caller (:func:`global_layer_name`, :func:`global_expert_name`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_rl.model_args import ModelArgs


@dataclass(frozen=True)
class ArchTable:
    """HF parameter names of one architecture ({i} = layer index)."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    input_norm: str = "model.layers.{i}.input_layernorm.weight"
    post_attn_norm: str = "model.layers.{i}.post_attention_layernorm.weight"
    q: str = "model.layers.{i}.self_attn.q_proj"
    k: str = "model.layers.{i}.self_attn.k_proj"
    v: str = "model.layers.{i}.self_attn.v_proj"
    qkv_fused: str | None = None
    """HF tensor holding [q; k; v] rows (Phi-3); replaces q/k/v."""
    o: str = "model.layers.{i}.self_attn.o_proj.weight"
    q_norm: str = "model.layers.{i}.self_attn.q_norm.weight"
    k_norm: str = "model.layers.{i}.self_attn.k_norm.weight"
    gate: str = "model.layers.{i}.mlp.gate_proj.weight"
    up: str = "model.layers.{i}.mlp.up_proj.weight"
    gate_up_fused: str | None = None
    """HF tensor holding [gate; up] rows (Phi-3); replaces gate/up."""
    down: str = "model.layers.{i}.mlp.down_proj.weight"
    router: str = "model.layers.{i}.mlp.gate.weight"
    """MoE router [num_experts, hidden] ({e} = expert index below)."""
    expert_gate: str = "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"
    expert_up: str = "model.layers.{i}.mlp.experts.{e}.up_proj.weight"
    expert_down: str = "model.layers.{i}.mlp.experts.{e}.down_proj.weight"
    module_router: str = "model.layers.{i}.mlp.gate.weight"
    """The router as a transformers (>= 5) model names its parameter (Mixtral's checkpoints say
    ``block_sparse_moe``, its module ``mlp``)."""
    module_experts_gate_up: str = "model.layers.{i}.mlp.experts.gate_up_proj"
    """transformers >= 5 holds a layer's experts fused in one parameter [E, 2 * moe_ffn, hidden]:
    expert e is [gate_e; up_e] (checkpoints keep one tensor per expert, ``expert_gate`` / ``expert_up``)."""
    module_experts_down: str = "model.layers.{i}.mlp.experts.down_proj"
    """The fused down projections [E, hidden, moe_ffn] (expert e's is ``expert_down``)."""
    shared_gate: str = "model.layers.{i}.mlp.shared_experts.gate_proj.weight"
    """The shared expert of an MoE layer (DeepSeek-V3, GLM-4.5; Qwen2-MoE says ``shared_expert``)."""
    shared_up: str = "model.layers.{i}.mlp.shared_experts.up_proj.weight"
    shared_down: str = "model.layers.{i}.mlp.shared_experts.down_proj.weight"
    shared_expert_gate: str = "model.layers.{i}.mlp.shared_expert_gate.weight"
    """Qwen2-MoE's sigmoid gate on the shared expert's output [1, hidden]."""
    router_bias: str = "model.layers.{i}.mlp.gate.e_score_correction_bias"
    """The expert-score bias [E] of sigmoid routing (a buffer in transformers, fp32)."""
    q_a: str = "model.layers.{i}.self_attn.q_a_proj.weight"
    """Multi-latent attention: the query's down projection [q_lora_rank, hidden] ..."""
    q_a_norm: str = "model.layers.{i}.self_attn.q_a_layernorm.weight"
    q_b: str = "model.layers.{i}.self_attn.q_b_proj.weight"
    """... and its up projection [heads * (nope + rope), q_lora_rank] (``q_proj`` without the rank)."""
    kv_a: str = "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"
    """[kv_lora_rank + rope, hidden]: the latent, then the rotary key shared by all heads."""
    kv_a_norm: str = "model.layers.{i}.self_attn.kv_a_layernorm.weight"
    kv_b: str = "model.layers.{i}.self_attn.kv_b_proj.weight"
    """[heads * (nope + v), kv_lora_rank]: per head its key's non-rotary part, then its value."""
    score: str = "score.weight"
    """``...ForSequenceClassification``'s head: nn.Linear(hidden, num_labels, bias=False), [1, hidden]
    for a reward model (the Megatron reward model's ``output_layer.weight``, replicated over TP)."""


LLAMA = ArchTable()
TABLES: dict[str, ArchTable] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,  # + q/k/v biases (ModelArgs.qkv_bias)
    "qwen3": LLAMA,  # + per-head q/k RMSNorm (ModelArgs.qk_norm)
    "phi3": ArchTable(
        qkv_fused="model.layers.{i}.self_attn.qkv_proj",
        gate_up_fused="model.layers.{i}.mlp.gate_up_proj.weight",
    ),
    "qwen3_moe": LLAMA,  # + q/k norms; MoE layers per ModelArgs.moe_layers, dense ones as Llama's
    "mixtral": ArchTable(
        router="model.layers.{i}.block_sparse_moe.gate.weight",
        expert_gate="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
        expert_up="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        expert_down="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    ),
    "qwen2_moe": ArchTable(  # + q/k/v biases; the shared expert and its gate
        shared_gate="model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        shared_up="model.layers.{i}.mlp.shared_expert.up_proj.weight",
        shared_down="model.layers.{i}.mlp.shared_expert.down_proj.weight",
    ),
    "glm4_moe": LLAMA,  # + q/k/v biases, q/k norms (options); sigmoid router's bias, shared expert
    "deepseek_v3": LLAMA,  # multi-latent attention; sigmoid router's bias, shared expert
}


@dataclass(frozen=True)
class Piece:
    hf_name: str
    start: int
    stop: int
    """Rows [start, stop) of the HF tensor (columns when the parameter's dim is 1)."""


@dataclass(frozen=True)
class ParamLayout:
    """How one Megatron parameter is assembled from HF tensors."""

    name: str
    """Megatron name with the global layer index."""
    dim: int | None
    """TP split dimension: 0 column-parallel, 1 row-parallel, None replicated."""
    shard_rows: int
    """Size of one TP shard along ``dim`` (includes vocabulary padding)."""
    pieces: tuple[tuple[Piece, ...], ...]
    """pieces[r]: HF blocks laid along ``dim`` in TP shard r; the rest of the shard is padding."""
    expert: int | None = None
    """Global expert index of an expert's parameter: its shards are over the expert TP group (ETP
    ranks), and it lives only on the EP rank that owns the expert."""
    width: int = 0
    """Columns of the HF matrix when they are not ``hidden_size`` (multi-latent attention's up
    projections read the latent)."""
    fp32: bool = False
    """Kept in float32 whatever the model's dtype (sigmoid routing's expert-score bias)."""

    def shard_rank(self, tp_rank: int, etp_rank: int) -> int:
        """Which entry of ``pieces`` a rank holds."""
        return tp_rank if self.expert is None else etp_rank


def _rows(name: str, start: int, stop: int) -> Piece:
    return Piece(name, start, stop)


def _split(name: str, total: int, tp: int, dim: int | None, mname: str) -> ParamLayout:
    """A tensor split evenly over TP along ``dim`` (or replicated when dim is None)."""
    if dim is None:
        return ParamLayout(mname, None, total, ((_rows(name, 0, total),),) * tp)
    n = total // tp
    return ParamLayout(mname, dim, n, tuple((_rows(name, r * n, (r + 1) * n),) for r in range(tp)))


def _swiglu(
    gn: str, un: str, dn: str, u_off: int, f: int, tp: int, p: str, expert: int | None = None
) -> list[ParamLayout]:
    """linear_fc1 ([gate_r; up_r] per shard) and linear_fc2 (row-parallel) of one SwiGLU MLP."""
    n = f // tp
    fc1 = tuple(
        (_rows(gn, r * n, (r + 1) * n), _rows(un, u_off + r * n, u_off + (r + 1) * n)) for r in range(tp)
    )
    fc2 = _split(dn, f, tp, 1, f"{p}linear_fc2.weight")
    return [
        ParamLayout(f"{p}linear_fc1.weight", 0, 2 * n, fc1, expert),
        ParamLayout(fc2.name, fc2.dim, fc2.shard_rows, fc2.pieces, expert),
    ]


def param_layouts(args: ModelArgs, tp: int, role: str = "actor", etp: int | None = None) -> list[ParamLayout]:
    """Every Megatron parameter of the full model (all pipeline stages, all experts), in model order.

    ``role="critic"`` leaves out the LM head: the critic's value head has no HF counterpart.
    ``role="reward"`` has the sequence-classification ``score`` head [1, hidden] in its place.
    ``etp`` is the expert tensor-parallel size (megatron's default: ``tp``).
    """
    etp = tp if etp is None else etp
    t = TABLES[args.arch]
    h, f = args.hidden_size, args.ffn_hidden_size
    vp = args.padded_vocab(tp)
    out: list[ParamLayout] = []

    def vocab(hf_name: str, mname: str) -> ParamLayout:
        n = vp // tp
        pieces = tuple(
            (_rows(hf_name, r * n, min((r + 1) * n, args.vocab_size)),) if r * n < args.vocab_size else ()
            for r in range(tp)
        )
        return ParamLayout(mname, 0, n, pieces)

    out.append(vocab(t.embed, "embedding.word_embeddings.weight"))
    for i in range(args.num_layers):
        p = f"decoder.layers.{i}."
        if args.mla is not None:
            out += _mla(args, t, i, tp, p)
        else:
            out += _gqa(args, t, i, tp, p)
        out.append(_split(t.input_norm.format(i=i), h, tp, None, f"{p}input_layernorm.weight"))
        out.append(_split(t.post_attn_norm.format(i=i), h, tp, None, f"{p}pre_mlp_layernorm.weight"))
        if args.is_moe_layer(i):
            out += _moe(args, t, i, tp, etp, p)
            continue
        if t.gate_up_fused:
            gn = un = t.gate_up_fused.format(i=i)
            u_off = f
        else:
            gn, un, u_off = t.gate.format(i=i), t.up.format(i=i), 0
        out += _swiglu(gn, un, t.down.format(i=i), u_off, f, tp, f"{p}mlp.")
    out.append(_split(t.final_norm, h, tp, None, "decoder.final_layernorm.weight"))
    if role == "actor":
        head = t.embed if args.tie_embeddings else t.lm_head
        out.append(vocab(head, "output_layer.weight"))
    elif role == "reward":  # one row (num_labels=1), the same on every TP rank
        out.append(_split(t.score, 1, tp, None, "output_layer.weight"))
    return out


def _gqa(args: ModelArgs, t: ArchTable, i: int, tp: int, p: str) -> list[ParamLayout]:
    """Grouped-query attention: the fused group-major ``linear_qkv`` (+ biases), ``linear_proj`` and
    the per-head q/k norms."""
    hd, g, qpg = args.head_dim, args.num_kv_heads, args.heads_per_group
    out: list[ParamLayout] = []
    q_off = k_off = v_off = 0
    if t.qkv_fused:
        qn = kn = vn = t.qkv_fused.format(i=i)
        k_off, v_off = args.num_heads * hd, (args.num_heads + g) * hd
    else:
        qn, kn, vn = (x.format(i=i) for x in (t.q, t.k, t.v))
    for suffix in ("weight", "bias") if args.qkv_bias else ("weight",):
        groups_per_rank = g // tp
        pieces = []
        for r in range(tp):
            rank_pieces = []
            for gi in range(r * groups_per_rank, (r + 1) * groups_per_rank):
                rank_pieces += [
                    _rows(f"{qn}.{suffix}", q_off + gi * qpg * hd, q_off + (gi + 1) * qpg * hd),
                    _rows(f"{kn}.{suffix}", k_off + gi * hd, k_off + (gi + 1) * hd),
                    _rows(f"{vn}.{suffix}", v_off + gi * hd, v_off + (gi + 1) * hd),
                ]
            pieces.append(tuple(rank_pieces))
        rows = groups_per_rank * (qpg + 2) * hd
        out.append(ParamLayout(f"{p}self_attention.linear_qkv.{suffix}", 0, rows, tuple(pieces)))
    out.append(_split(t.o.format(i=i), args.num_heads * hd, tp, 1, f"{p}self_attention.linear_proj.weight"))
    if args.qk_norm:
        out.append(_split(t.q_norm.format(i=i), hd, tp, None, f"{p}self_attention.q_layernorm.weight"))
        out.append(_split(t.k_norm.format(i=i), hd, tp, None, f"{p}self_attention.k_layernorm.weight"))
    return out


def _mla(args: ModelArgs, t: ArchTable, i: int, tp: int, p: str) -> list[ParamLayout]:
    """Multi-latent attention as this project builds it: the down projections whole on every TP rank
    (models.mla.DuplicatedLinear), the up projections column-parallel with the heads split
    contiguously over TP, ``linear_proj`` row-parallel. The rotary dims stay interleaved as DeepSeek
    stores them: megatron's MLA de-interleaves them before rotating, as transformers does."""
    m, heads = args.mla, args.num_heads
    assert m is not None
    a = f"{p}self_attention."
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    out: list[ParamLayout] = []
    if m.q_lora_rank is None:
        out.append(_split(t.q.format(i=i) + ".weight", heads * qk, tp, 0, f"{a}linear_q_proj.weight"))
    else:
        r = m.q_lora_rank
        out.append(_split(t.q_a.format(i=i), r, tp, None, f"{a}linear_q_down_proj.weight"))
        out.append(_split(t.q_a_norm.format(i=i), r, tp, None, f"{a}q_layernorm.weight"))
        up = _split(t.q_b.format(i=i), heads * qk, tp, 0, f"{a}linear_q_up_proj.weight")
        out.append(dataclasses.replace(up, width=r))
    kv_rows = m.kv_lora_rank + m.qk_rope_head_dim
    out.append(_split(t.kv_a.format(i=i), kv_rows, tp, None, f"{a}linear_kv_down_proj.weight"))
    out.append(_split(t.kv_a_norm.format(i=i), m.kv_lora_rank, tp, None, f"{a}kv_layernorm.weight"))
    kv_up = _split(t.kv_b.format(i=i), heads * (m.qk_nope_head_dim + m.v_head_dim), tp, 0, "")
    out.append(dataclasses.replace(kv_up, name=f"{a}linear_kv_up_proj.weight", width=m.kv_lora_rank))
    out.append(_split(t.o.format(i=i), heads * m.v_head_dim, tp, 1, f"{a}linear_proj.weight"))
    return out


def _moe(args: ModelArgs, t: ArchTable, i: int, tp: int, etp: int, p: str) -> list[ParamLayout]:
    """An MoE layer: the router (replicated; its expert-score bias with sigmoid routing), the experts
    (over EP whole, over ETP in shards) and the shared expert (over TP, like a dense MLP)."""
    e_count = args.num_experts
    out = [_split(t.router.format(i=i), e_count, tp, None, f"{p}mlp.router.weight")]
    if args.moe_expert_bias:
        bias = _split(t.router_bias.format(i=i), e_count, tp, None, f"{p}mlp.router.expert_bias")
        out.append(dataclasses.replace(bias, fp32=True))
    for e in range(e_count):
        gate, up, down = (x.format(i=i, e=e) for x in (t.expert_gate, t.expert_up, t.expert_down))
        out += _swiglu(
            gate, up, down, 0, args.moe_ffn_hidden_size, etp, f"{p}mlp.experts.local_experts.{e}.", e
        )
    if args.moe_shared_ffn_hidden_size:
        gate, up, down = (x.format(i=i) for x in (t.shared_gate, t.shared_up, t.shared_down))
        out += _swiglu(gate, up, down, 0, args.moe_shared_ffn_hidden_size, tp, f"{p}mlp.shared_experts.")
        if args.moe_shared_expert_gate:
            gate = t.shared_expert_gate.format(i=i)
            out.append(_split(gate, 1, tp, None, f"{p}mlp.shared_experts.gate_weight"))
    return out


def hf_shapes(args: ModelArgs, role: str = "actor") -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor (what an exported model directory holds)."""
    shapes: dict[str, tuple[int, ...]] = {}
    h = args.hidden_size
    for lay in param_layouts(args, 1, role):
        vector = lay.name.endswith(("bias", "layernorm.weight"))
        for pc in lay.pieces[0]:
            if lay.dim == 1:  # row-parallel: HF [hidden, in_features]
                shapes[pc.hf_name] = (h, pc.stop)
            else:  # every other matrix has in_features = hidden (or its layout's width)
                rows = max(pc.stop, shapes.get(pc.hf_name, (0,))[0])
                shapes[pc.hf_name] = (rows,) if vector else (rows, lay.width or h)
    return shapes


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_layer_name(local_name: str, layer_offset: int) -> str:
    """``decoder.layers.{j}.x`` of a pipeline stage -> ``decoder.layers.{offset+j}.x``."""
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{local_name[m.end() :]}"


def local_layer_name(global_name: str, layer_offset: int) -> str:
    m = _LAYER_RE.match(global_name)
    if not m:
        return global_name
    return f"decoder.layers.{int(m.group(1)) - layer_offset}.{global_name[m.end() :]}"


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _shift_expert(name: str, delta: int) -> str:
    m = _EXPERT_RE.search(name)
    if not m:
        return name
    return f"{name[: m.start(1)]}{int(m.group(1)) + delta}{name[m.end(1) :]}"


def global_expert_name(local_name: str, expert_offset: int) -> str:
    """``...local_experts.{j}.x`` of an EP rank -> ``...local_experts.{offset+j}.x``."""
    return _shift_expert(local_name, expert_offset)


def local_expert_name(global_name: str, expert_offset: int) -> str:
    return _shift_expert(global_name, -expert_offset)


def iter_stage_layouts(
    args: ModelArgs,
    tp: int,
    pp: int,
    pp_rank: int,
    role: str = "actor",
    ep: int = 1,
    ep_rank: int = 0,
    etp: int | None = None,
    stage_layers: Sequence[int] | None = None,
) -> Iterator[ParamLayout]:
    """The layouts of the parameters that live on one pipeline stage (and, of the experts, those
    of EP rank ``ep_rank``); ``stage_layers``: the decoder layers of each stage (an uneven pipeline;
    None: ``num_layers / pp`` each)."""
    split = list(stage_layers) if stage_layers else [args.num_layers // pp] * pp
    lo = sum(split[:pp_rank])
    hi = lo + split[pp_rank]
    per_rank = args.num_experts // ep if args.is_moe else 0
    layouts = param_layouts(args, tp, role) if etp in (None, tp) else param_layouts(args, tp, role, etp)
    for lay in layouts:
        if lay.expert is not None and not ep_rank * per_rank <= lay.expert < (ep_rank + 1) * per_rank:
            continue
        i = layer_index(lay.name)
        if i is not None:
            if lo <= i < hi:
                yield lay
        elif lay.name.startswith("embedding.") and pp_rank == 0:
            yield lay
        elif lay.name.startswith(("decoder.final_layernorm", "output_layer")) and pp_rank == pp - 1:
            if lay.name.startswith("output_layer") and role == "actor" and args.tie_embeddings and pp == 1:
                continue  # tied: the embedding is the head (a reward model's score head is never tied)
            yield lay


def module_param_views(args: ModelArgs, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers model's parameters (``named_parameters()``) under the checkpoint names of the
    table, as views that share their storage: a MoE layer's fused experts become one
    [moe_ffn, hidden] gate / up and one [hidden, moe_ffn] down view per expert, Mixtral's
    ``mlp.gate`` its ``block_sparse_moe.gate``. A model that already names its experts one by one (no
    fused parameter) is returned as it is."""
    views = dict(params)
    if not args.is_moe:
        return views
    t, f = TABLES[args.arch], args.moe_ffn_hidden_size
    for i in range(args.num_layers):
        if not args.is_moe_layer(i):
            continue
        router = t.module_router.format(i=i)
        if router in views and router != t.router.format(i=i):
            views[t.router.format(i=i)] = views.pop(router)
        gate_up, down = t.module_experts_gate_up.format(i=i), t.module_experts_down.format(i=i)
        if gate_up not in views:
            continue
        fused_gate_up, fused_down = views.pop(gate_up), views.pop(down)  # [E, 2f, h], [E, h, f]
        for e in range(args.num_experts):
            views[t.expert_gate.format(i=i, e=e)] = fused_gate_up[e, :f]
            views[t.expert_up.format(i=i, e=e)] = fused_gate_up[e, f:]
            views[t.expert_down.format(i=i, e=e)] = fused_down[e]
    return views
