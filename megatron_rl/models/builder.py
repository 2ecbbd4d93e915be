"""Build megatron-core GPTModels (actor, reference, critic) from :class:`ModelArgs` and fill them.

Layer spec: megatron-core's local spec (no Transformer Engine needed) or, where Transformer Engine
imports, its TE spec (``*.megatron.override_transformer_config.transformer_impl``, models/te_spec.py:
norms fused into the next linear, TE's grouped experts); RMSNorm, SwiGLU, RoPE with HF's
non-interleaved rotation, optionally torch's fused scaled_dot_product_attention as the core
attention. The parameters keep the local spec's names wherever they are read (:func:`named_global_params`).
The critic is the same trunk with its vocabulary head replaced by a scalar value head; the
reward model (``role="reward"``) likewise, with HF's sequence-classification ``score`` head (no bias).
A mixture-of-experts model (Qwen3-MoE, Mixtral) has megatron's MoELayer in its sparse layers: the
TopKRouter (fp32 logits), the alltoall token dispatcher over the expert-parallel group, and the
experts of this EP rank: :class:`~megatron_rl.models.experts.GroupedExperts` (one grouped matmul per
projection, the default) or megatron's SequentialMLP (one MLP per expert; ``moe_grouped_gemm=False``).

Each rank builds only its pipeline stage and holds only its TP shard; :func:`load_hf_weights`
reads exactly those slices from the safetensors files. With interleaved pipelines
(``TrainingOptions.virtual_pipeline`` > 1) a stage is several GPTModels, one per virtual stage, in a
:class:`~megatron_rl.models.chunks.ModelChunks`; the helpers here walk its chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rl import cpu_bridge
from megatron_rl.config.layout import pipeline_split
from megatron_rl.model_args import ModelArgs
from megatron_rl.models import te_spec
from megatron_rl.models.chunks import ModelChunks, chunks_of
from megatron_rl.models.layers import RMSNorm, SDPAttention, ValueHead
from megatron_rl.models.mla import duplicated_linear
from megatron_rl.parallel import ParallelState
from megatron_rl.weights.hf_io import HFReader, assemble_shard
from megatron_rl.weights.tables import TABLES, global_expert_name, global_layer_name, iter_stage_layouts


@dataclass(frozen=True)
class TrainingOptions:
    """How a trained model runs its layers (from its config section; the reference keeps the defaults)."""

    sequence_parallel: bool = False
    """Split activations outside attention/MLP along the sequence over TP (needs TP > 1)."""
    recompute_granularity: str | None = None
    """None | full | selective: recompute activations in the backward pass instead of storing them."""
    recompute_method: str | None = None
    """uniform | block (full recompute): which layers are recomputed."""
    recompute_num_layers: int | None = None
    """Layers per recompute chunk (uniform) or recomputed layers per stage (block)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: coefficient of the load-balancing loss (megatron's ``aux_loss``; 0 turns it off)."""
    moe_z_loss_coeff: float = 0.0
    """MoE: coefficient of the router z-loss (mean squared logsumexp of the router logits; 0: off)."""
    moe_grouped_gemm: bool = True
    """MoE: run a rank's experts as grouped matmuls (GroupedExperts) rather than one MLP per expert
    (megatron's SequentialMLP); both hold the same weights and write the same checkpoints."""
    moe_router_bias_update_rate: float = 1e-3
    """MoE with sigmoid routing (DeepSeek-V3, GLM-4.5): after each optimizer step the expert-score bias
    moves by this much against each expert's load over the step's tokens (megatron's
    auxiliary-loss-free balancing; 0 keeps the checkpoint's bias)."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline stage (*.megatron.virtual_pipeline_model_parallel_size; interleaved
    1F1B when > 1): build_model returns a :class:`~megatron_rl.models.chunks.ModelChunks`."""
    transformer_overrides: tuple = ()
    """(key, value) pairs of TransformerConfig arguments set over the ones built here: the section's
    megatron.override_transformer_config without its moe_* keys (recompute_modules; transformer_impl
    picks the layer spec)."""
    lora: bool = False
    """LoRA adapters will be added (they run on the local layers only)."""
    packed_sequences: bool = False
    """Run every pass with each micro-batch's sequences packed into one row (THD, models/packing.py;
    ``*.megatron.use_remove_padding``); needs the SDPA core attention."""


def moe_config_kwargs(args: ModelArgs, ps: ParallelState, options: TrainingOptions) -> dict:
    """TransformerConfig fields of an MoE model (empty for a dense one)."""
    if not args.is_moe:
        return {}
    sigmoid_routing: dict = {}
    if args.moe_score_function == "sigmoid":
        # megatron renormalises the top-k sigmoid scores whenever k > 1 (norm_topk_prob), then scales
        sigmoid_routing = dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=args.moe_expert_bias,
            moe_router_bias_update_rate=options.moe_router_bias_update_rate,
            moe_router_num_groups=args.moe_num_groups or None,
            moe_router_group_topk=args.moe_group_topk or None,
        )
    shared: dict = {}
    if args.moe_shared_ffn_hidden_size:
        shared = dict(
            moe_shared_expert_intermediate_size=args.moe_shared_ffn_hidden_size,
            moe_shared_expert_gate=args.moe_shared_expert_gate,
        )
    return dict(
        moe_router_topk_scaling_factor=args.moe_routed_scaling if args.moe_routed_scaling != 1.0 else None,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_top_k,
        # norm_topk_prob: softmax over the top-k logits (= renormalised top-k probabilities);
        # otherwise the top-k of the softmax over all experts.
        moe_router_pre_softmax=not args.moe_norm_topk_prob and args.moe_score_function == "softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if options.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=options.moe_aux_loss_coeff,
        moe_z_loss_coeff=options.moe_z_loss_coeff or None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_layer_freq=[int(x) for x in args.moe_layers],
        expert_model_parallel_size=ps.ep_size,
        expert_tensor_parallel_size=ps.etp_size,
        **({"moe_router_score_function": "softmax"} | sigmoid_routing),
        **shared,
    )


def mla_config_kwargs(args: ModelArgs) -> dict:
    """MLATransformerConfig fields of a multi-latent-attention model (empty otherwise)."""
    m = args.mla
    if m is None:
        return {}
    y = args.yarn
    rope = (
        dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        if y is None
        else dict(
            rope_type="yarn",
            rotary_scaling_factor=y.factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            mscale=y.mscale,
            mscale_all_dim=y.mscale_all_dim,
        )
    )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rotary_base=args.rope_theta,
        **rope,
    )


def transformer_config(
    args: ModelArgs,
    ps: ParallelState,
    dtype: torch.dtype,
    options: TrainingOptions = TrainingOptions(),
    impl: str = te_spec.LOCAL,
):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    config_class = TransformerConfig if args.mla is None else MLATransformerConfig
    vpp = options.virtual_pipeline if options.virtual_pipeline > 1 else None  # megatron: None, not 1
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ps.tp_size,
        pipeline_model_parallel_size=ps.pp_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        attention_softmax_in_fp32=True,
        # Losses arrive already normalised by the mini-batch's global token (or sequence) count: the
        # schedule must not divide them again by the number of micro-batches.
        calculate_per_token_loss=True,
        sequence_parallel=options.sequence_parallel and ps.tp_size > 1,
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method if options.recompute_granularity == "full" else None,
        recompute_num_layers=options.recompute_num_layers
        if options.recompute_granularity == "full"
        else None,
        **moe_config_kwargs(args, ps, options),
        **mla_config_kwargs(args),
        virtual_pipeline_model_parallel_size=vpp,
        # interleaved: megatron's p2p with its even/odd ordering (at PP2 a rank's previous and next
        # stage are one peer, and batched sends to it would pair an activation with a gradient)
        **({"overlap_p2p_comm": True, "batch_p2p_comm": False} if vpp else {}),
    )
    if impl == te_spec.TRANSFORMER_ENGINE:
        fields.update(te_spec.te_config_kwargs())
    fields.update((k, v) for k, v in options.transformer_overrides if k != "transformer_impl")
    return config_class(**fields)


def build_model(
    args: ModelArgs,
    ps: ParallelState,
    role: str = "actor",
    dtype: torch.dtype = torch.float32,
    sdpa: bool = True,
    options: TrainingOptions = TrainingOptions(),
) -> nn.Module:
    """This rank's pipeline stage of the actor/ref (``role="actor"``), critic (``role="critic"``) or
    reward model (``role="reward"``: the trunk + a [1, H] score head, output [b, s, 1] like the critic's,
    filled from an HF ``...ForSequenceClassification``'s ``score.weight``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from megatron_rl.models.experts import GroupedExperts

    if role not in ("actor", "critic", "reward"):
        raise ValueError(f"role must be actor, critic or reward, got {role!r}")
    if args.is_moe and args.num_experts % ps.ep_size:
        raise ValueError(
            f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ps.ep_size} does not divide the "
            f"model's {args.num_experts} experts: choose a divisor of {args.num_experts}."
        )
    local_only = {"mla"} if args.mla is not None else set()
    local_only |= {"lora"} if options.lora else set()
    requested = dict(options.transformer_overrides).get("transformer_impl")
    impl, notice = te_spec.choose_impl(requested, local_only=local_only)
    te_spec.check_fp8(dict(options.transformer_overrides).get("fp8"), impl, notice)
    if requested is not None or te_spec.te_import_error() is None:  # without TE: parallel.te_notice
        te_spec.announce(notice, ps.rank)
    config = transformer_config(args, ps, dtype, options, impl)

    def layer_spec(num_experts: int | None):
        mla = args.mla is not None
        grouped = ModuleSpec(module=GroupedExperts) if options.moe_grouped_gemm else None
        if impl == te_spec.TRANSFORMER_ENGINE:  # TE's norms and linears; the core attention and experts ours
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            core = SDPAttention if sdpa else DotProductAttention
            return te_spec.te_layer(num_experts, args.qk_norm, grouped, core)
        layer = get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=args.qk_norm or mla,  # MLA: the norms of the q and kv latents
            multi_latent_attention=mla,
            normalization="RMSNorm",
        )
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
        attn = sub.self_attention.submodules
        if mla:
            attn.q_layernorm = attn.kv_layernorm = RMSNorm
            attn.linear_q_down_proj = attn.linear_kv_down_proj = duplicated_linear()
        elif args.qk_norm:
            attn.q_layernorm = attn.k_layernorm = RMSNorm
        if sdpa or mla:  # megatron's local DotProductAttention has no separate value width (MLA's)
            sub.self_attention.submodules.core_attention = SDPAttention
        if num_experts and grouped is not None:
            sub.mlp.submodules.experts = grouped
        return layer

    dense = layer_spec(None)
    sparse = layer_spec(args.num_experts) if args.is_moe else None
    # uneven pipelines: megatron's num_layers_in_first/last_pipeline_stage (override_transformer_config);
    # interleaved: the layers of each virtual stage (chunk v of this rank is virtual stage v * PP + p)
    vpp = config.virtual_pipeline_model_parallel_size or 1
    split = pipeline_split(
        args.num_layers,
        ps.pp_size,
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
        vpp,
    )
    chunks = []
    for v in range(vpp):
        stage = v * ps.pp_size + ps.pp_rank
        offset = sum(split[:stage])
        layers = [sparse if args.is_moe_layer(offset + j) else dense for j in range(split[stage])]
        spec = ModuleSpec(
            module=TransformerBlock,
            submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm),
        )
        last = stage == len(split) - 1
        with cpu_bridge.device_mode():
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=args.padded_vocab(ps.tp_size),
                max_sequence_length=args.max_position_embeddings,
                pre_process=stage == 0,
                post_process=last,
                share_embeddings_and_output_weights=args.tie_embeddings and role == "actor",
                position_embedding_type="rope",
                rotary_percent=args.rotary_percent,
                rotary_base=int(args.rope_theta),
                rope_scaling=args.rope_scaling,
                rope_scaling_factor=args.rope_scaling_factor,
                **({"vp_stage": v} if vpp > 1 else {}),
            )
        if role in ("critic", "reward") and last:
            bias = role == "critic"  # HF's score head has none
            model.output_layer = ValueHead(args.hidden_size, dtype, config.sequence_parallel, bias=bias)
        model.layer_offset = offset
        model.virtual_stage = stage
        chunks.append(model)
    model = chunks[0] if vpp == 1 else ModelChunks(chunks)
    model.args = args
    model.role = role
    model.transformer_impl = impl
    model.packed_sequences = options.packed_sequences
    model.stage_layers = split  # decoder layers of each (virtual) pipeline stage
    model.expert_offset = ps.ep_rank * (args.num_experts // ps.ep_size) if args.is_moe else 0
    for chunk in chunks:
        chunk.args, chunk.role, chunk.expert_offset = args, role, model.expert_offset
        chunk.transformer_impl = impl
        chunk.packed_sequences = options.packed_sequences
    mark_tensor_parallel(model, ps)
    return model.to(ps.device)


def mark_tensor_parallel(model: nn.Module, ps: ParallelState) -> None:
    """Set megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes from the layout tables.

    megatron only sets them when it initialises weights itself (perform_initialization=False skips
    that); its grad-norm and DDP code, and ours, tell sharded from replicated parameters by them.
    """
    params = named_global_params(model)
    for lay in stage_layouts(model, ps):
        p = params[lay.name]
        stacked = p._base is not None  # one expert's view of GroupedExperts' [E_local, ...] weight
        p = p._base if stacked else p
        p.tensor_model_parallel = (
            lay.dim is not None and (ps.tp_size if lay.expert is None else ps.etp_size) > 1
        )
        p.partition_dim = -1 if lay.dim is None else lay.dim + stacked
        p.partition_stride = 1


def stage_layouts(model: nn.Module, ps: ParallelState) -> list:
    """The table's layouts of the parameters this rank holds (its stage or its chunks' virtual
    stages, its experts)."""
    split = getattr(model, "stage_layers", None)
    stages = len(split) if split else ps.pp_size
    return [
        lay
        for chunk in chunks_of(model)
        for lay in iter_stage_layouts(
            model.args,
            ps.tp_size,
            stages,
            getattr(chunk, "virtual_stage", ps.pp_rank),
            model.role,
            ps.ep_size,
            ps.ep_rank,
            ps.etp_size,
            stage_layers=split,
        )
    ]


def named_global_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameters under their global (full-model) names: global layer and expert index
    (over all model chunks of an interleaved pipeline).

    The stacked weights of GroupedExperts appear as one view per expert, under SequentialMLP's names
    (those of the layout tables); writing into a view writes the parameter."""
    from megatron_rl.models.experts import GroupedExperts
    from megatron_rl.models.lora import is_adapter_param

    out: dict[str, torch.Tensor] = {}
    off = getattr(model, "expert_offset", 0)
    for chunk in chunks_of(model):
        # LoRA adapters have no HF counterpart: the stream reads them through models.lora.merged_params
        local = {n: p for n, p in chunk.named_parameters() if not is_adapter_param(n)}
        # sigmoid routing's expert-score bias: a buffer (trained by load balancing, not by gradients)
        local.update({n: b for n, b in chunk.named_buffers() if n.endswith("router.expert_bias")})
        for prefix, module in chunk.named_modules():
            if isinstance(module, GroupedExperts):
                del local[f"{prefix}.weight1"], local[f"{prefix}.weight2"]
                local.update({f"{prefix}.{n}": v for n, v in module.expert_views().items()})
        if getattr(model, "transformer_impl", te_spec.LOCAL) == te_spec.TRANSFORMER_ENGINE:
            local = te_spec.te_global_names(local)  # TE's fused-norm and grouped-expert names -> the tables'
        out.update(
            {global_expert_name(global_layer_name(n, chunk.layer_offset), off): p for n, p in local.items()}
        )
    return out


@torch.no_grad()
def fill_from_reader(model: nn.Module, ps: ParallelState, reader, progress: bool = False) -> None:
    """Fill this rank's shard of ``model`` from HF tensors served by ``reader`` (``read(piece, dim)``),
    whatever format stores them (HF safetensors, legacy Megatron-LM, torch_dist)."""
    from tqdm import tqdm

    params = named_global_params(model)
    layouts = stage_layouts(model, ps)
    if model.role == "reward" and ps.is_last_stage:
        check_score_head(reader, model.args)
    for lay in tqdm(layouts, desc="loading", disable=None if progress else True, leave=False):
        p = params.get(lay.name)
        if p is None:
            raise KeyError(f"Megatron model has no parameter {lay.name} (table/model mismatch)")
        p.copy_(assemble_shard(lay, lay.shard_rank(ps.tp_rank, ps.etp_rank), reader.read, p))
    value_head = {"output_layer.weight", "output_layer.bias"} if model.role == "critic" else set()
    missing = set(params) - {lay.name for lay in layouts} - value_head
    if missing:
        raise KeyError(f"Parameters not covered by the {model.args.arch} table: {sorted(missing)}")


def check_score_head(reader, args: ModelArgs) -> None:
    """A reward model's score head must exist and have one row (num_labels=1): the table reads rows
    [0, 1) of it, which would silently take the first label of a wider head."""
    name = TABLES[args.arch].score
    where = getattr(reader, "path", "the checkpoint")
    if name not in reader.keys():
        raise KeyError(
            f"{where} has no {name}: a reward model loads from an HF ...ForSequenceClassification "
            "(num_labels=1) or a torch_dist checkpoint of one, not from a causal LM."
        )
    shape = tuple(reader.get(name).shape)
    if shape != (1, args.hidden_size):
        raise ValueError(
            f"{where}: {name} has shape {shape}, a reward model needs (1, {args.hidden_size}) "
            "(num_labels=1, a scalar score); re-save the classifier with num_labels=1."
        )


def load_hf_weights(model: nn.Module, path: str, ps: ParallelState) -> HFReader:
    """Fill this rank's shard from an HF directory, reading only its slices. Returns the reader
    (its ``bytes_read`` says how much was materialised)."""
    reader = HFReader(path)
    fill_from_reader(model, ps, reader)
    return reader
