"""Running Megatron models over micro-batches: masks, the pipeline schedule, TP gathers.

Every forward in the trainer (old/ref log-probs, values, the PPO update) goes through
:func:`run_pipeline`, which hands megatron's ``get_forward_backward_func`` a forward step that
returns ``(output, loss_fn)``; megatron hides micro-batching and pipeline p2p. On the last stage
``loss_fn(mb, output)`` turns this micro-batch's output ([b, s, vocab/TP] logits, [b, r, 2] fused
log-probs and entropy, or [b, s, 1] values) into either collected data (forward only) or
``(loss, num_tokens, metrics)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl import cpu_bridge
from megatron_rl.config.errors import ConfigError
from megatron_rl.models import routing
from megatron_rl.models.chunks import chunks_of, last_chunk
from megatron_rl.models.te_spec import FP8_TOKENS
from megatron_rl.parallel import ParallelState


class MicroBatch(Protocol):
    input_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor  # [b, s], 1 for real tokens (left and/or right padding is 0)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] keep-mask -> megatron's [b, 1, s, s] bool mask, True where attention is blocked.

    Causal and key-padding masked; the diagonal stays open so that a padding query never has an
    all-masked row (that would give NaN in fused attention, and NaN * 0 still poisons real rows).
    """
    b, s = attention_mask.shape
    keep = attention_mask.bool()
    causal = torch.ones(s, s, dtype=torch.bool, device=keep.device).tril()
    allowed = causal[None] & keep[:, None, :]
    allowed |= torch.eye(s, dtype=torch.bool, device=keep.device)[None]
    return (~allowed)[:, None]


Positions = slice | torch.Tensor
"""Sequence positions: one slice for every row, or per-row positions [b, r] (long)."""


def select_positions(x: torch.Tensor, where: Positions, seq_first: bool) -> torch.Tensor:
    """``x`` [s, b, ...] (``seq_first``) or [b, s, ...] at positions ``where``: [r, b, ...] or [b, r, ...]."""
    if isinstance(where, slice):
        return x[where] if seq_first else x[:, where]
    rows = torch.arange(where.shape[0], device=x.device)
    where = where.to(x.device)
    return x[where.T, rows] if seq_first else x[rows[:, None], where]


Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A replacement of the LM head: ``head(hidden [r, b, h], weight [V_pad/TP, h]) -> [r, b, k]``."""


@contextlib.contextmanager
def output_positions(
    model: torch.nn.Module,
    positions: Callable[[], Positions] | None,
    head: Head | None = None,
    packed: bool = False,
) -> Iterator[None]:
    """Only sequence positions ``positions()`` reach the output layer: the model returns [b, r, ...].

    Log-probs need the LM head on the response positions alone; with a 150k vocabulary the head is
    ~15% of a 1.5B model's FLOPs and its [b, s, V/TP] logits the largest activation, so computing it
    on the prompt too would waste both. The output layer's input, the decoder output [s, b, h], is
    sliced before the head; gradients flow back to those positions. ``positions`` is asked at every
    forward (the micro-batches of one pass may have different widths). Under sequence parallelism the
    decoder output is [s/TP, b, h]: it is gathered first and the head runs without its own gather (one
    all-reduce of the sliced input's gradient replaces the head's reduce-scatter).

    With ``head``, the output layer's matmul is replaced: ``head(hidden, weight)`` gets the (sliced,
    gathered) final hidden states [r, b, h] and the weight megatron would multiply them with (the
    output layer's, or the tied embedding's), and its [r, b, k] result is what the model returns
    (as [b, r, k]). ``head`` then owns the TP all-reduce of the hidden states' gradient.

    ``packed``: the decoder output is one packed row [T, 1, h] (models/packing.py) and ``positions()``
    gives packed positions [b, r]: the head reads [r, b, h], as in a padded pass.
    """
    layer = getattr(model, "output_layer", None)  # absent before the last pipeline stage
    if layer is None or (positions is None and head is None):
        yield
        return
    sequence_parallel = getattr(layer, "sequence_parallel", False)

    def gather_and_slice(x: torch.Tensor) -> torch.Tensor:
        if sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            x = gather_from_sequence_parallel_region(x, False)
        if positions is None:
            return x
        where = positions()
        if packed:  # [T, 1, h] at packed positions [b, r] -> [r, b, h]
            assert isinstance(where, torch.Tensor)  # models/packing.Packed.positions
            return x[:, 0][where.T.to(x.device)]
        return select_positions(x, where, seq_first=True)

    def keep(module, args, kwargs):
        return (gather_and_slice(args[0]), *args[1:]), kwargs

    def fused(input_, weight=None, runtime_gather_output=None):
        return head(gather_and_slice(input_), layer.weight if weight is None else weight), None

    if head is None:
        handle = layer.register_forward_pre_hook(keep, with_kwargs=True)
    else:
        layer.forward = fused  # the instance attribute shadows ColumnParallelLinear.forward
    layer.sequence_parallel = False
    try:
        yield
    finally:
        layer.sequence_parallel = sequence_parallel
        if head is None:
            handle.remove()
        else:
            del layer.forward


def packs(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs its passes packed (``*.megatron.use_remove_padding``, models/packing.py)."""
    inner = last_chunk(getattr(model, "module", model))
    return bool(getattr(getattr(inner, "module", inner), "packed_sequences", False))


def sequence_multiple(model: torch.nn.Module, ps: ParallelState) -> int:
    """The multiple each micro-batch's length is padded to: TP under sequence parallelism (else 1),
    times 16 under FP8 training (models/te_spec.FP8_TOKENS: each rank's token count)."""
    config: Any = getattr(model, "module", model).config  # megatron-core's TransformerConfig
    return (ps.tp_size if config.sequence_parallel else 1) * (FP8_TOKENS if config.fp8 else 1)


@contextlib.contextmanager
def _variable_shapes(config, on: bool) -> Iterator[None]:
    """Pipeline p2p sends each activation's shape first when the micro-batches differ in shape."""
    before = config.variable_seq_lengths
    config.variable_seq_lengths = before or on
    try:
        yield
    finally:
        config.variable_seq_lengths = before


_AUX_SCALE = [1.0]
"""The factor on megatron's MoE aux-loss gradient scale for the micro-batch in flight (see below)."""


def _install_aux_loss_scale() -> None:
    """Make the router losses (load balancing, z-loss) coefficient x their mean over the mini-batch's
    micro-batches and data-parallel ranks, like the policy loss.

    With ``calculate_per_token_loss`` megatron attaches each router loss times the micro-batch's token
    count and expects ``finalize_model_grads`` to divide every gradient by the global token count; our
    losses arrive normalised and that division is skipped (optim._finalize_grads). The schedule sets the
    aux-loss gradient scale after each micro-batch's forward: it is multiplied here by
    1 / (tokens x micro-batches x DP) of that micro-batch.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if getattr(MoEAuxLossAutoScaler, "_scaled_per_micro_batch", False):
        return
    megatron_set = MoEAuxLossAutoScaler.set_loss_scale

    def set_loss_scale(scale: torch.Tensor) -> None:
        megatron_set(scale * _AUX_SCALE[0])

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(set_loss_scale)
    MoEAuxLossAutoScaler._scaled_per_micro_batch = True


def run_pipeline(
    model: torch.nn.Module,
    ps: ParallelState,
    microbatches: Sequence[Any],
    loss_fn: Callable[[Any, torch.Tensor], Any],
    forward_only: bool,
    positions: Callable[[Any], Positions] | None = None,
    head: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> list:
    """One pass over ``microbatches`` ([b, s] each; shapes may differ between micro-batches) through
    the pipeline schedule.

    ``model`` is a model built by :mod:`megatron_rl.models.builder` or its DDP wrapper (training); a
    :class:`~megatron_rl.models.chunks.ModelChunks` (interleaved pipelines) runs megatron's interleaved
    1F1B over its chunks, each reading the micro-batches from its own iterator; their count must then
    be a multiple of PP: a forward-only pass repeats its last micro-batch to fill the group (outputs
    dropped), an update that does not fit is a ConfigError.
    Returns what ``loss_fn`` produced per micro-batch on the last stage (forward only), or the
    metrics dicts (training); an empty list on other stages. With ``positions(mb)``, the last stage's
    output covers only those sequence positions of ``mb`` (:func:`output_positions`). Under sequence
    parallelism each micro-batch is right-padded to a multiple of TP (outputs then hold the padded
    positions too). With ``head(mb, hidden [r, b, h], weight)`` the LM head's matmul is replaced by
    it (:func:`output_positions`) and the last stage's output is its result as [b, r, k], e.g. the
    fused log-probs of :func:`megatron_rl.models.logprobs.fused_log_probs_and_entropy`.
    A model built with packed sequences (:func:`packs`) runs each micro-batch as one packed row
    (models/packing.py); its outputs have the shapes of the padded pass (without the SP padding).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = chunks_of(model)  # interleaved: this rank's model chunks (DDP-wrapped when training)
    inner = getattr(chunks[-1], "module", chunks[-1])  # the chunk with the output layer, if any
    multiple = sequence_multiple(model, ps)
    count = len(microbatches)
    if len(chunks) > 1 and count % ps.pp_size:
        # interleaved 1F1B runs groups of PP micro-batches per chunk (config.layout.check_interleaving)
        if not forward_only:
            raise ConfigError(
                f"{count} micro-batches in an update, but interleaved pipelines need a multiple of "
                f"pipeline_model_parallel_size={ps.pp_size}: set *.ppo_micro_batch_size_per_gpu so that "
                "ppo_mini_batch_size x rollout.n / data-parallel size / it is one, or use_dynamic_bsz=true."
            )
        # forward only: the last micro-batch again fills the group; its outputs are dropped below
        microbatches = list(microbatches) + [microbatches[-1]] * (-count % ps.pp_size)
    shapes = {tuple(mb.input_ids.shape) for mb in microbatches}
    b, s = microbatches[0].input_ids.shape
    current: list = [None, None]  # the micro-batch in the forward, and its response positions
    packed = packs(model)
    if packed:
        from megatron_rl.models import packing
    moe = not forward_only and inner.config.num_moe_experts is not None
    if moe:
        _install_aux_loss_scale()
    replays = routing.replays_of(model)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        # R3: the routers take the engine's experts for these tokens (models/routing.py)
        routed = getattr(mb, "routed_experts", None) if replays else None
        if packed:  # one row of the real tokens (models/packing.py); outputs at the padded positions
            p = packing.pack(mb.input_ids, mb.attention_mask, multiple)
            ids, where = p.ids, p.positions(None if positions is None else positions(mb))
            routed = None if routed is None else p.rows(routed, routing.NONE)
            kwargs: dict[str, Any] = {"attention_mask": None, "packed_seq_params": p.params}
        else:
            ids, keep = mb.input_ids, mb.attention_mask
            pad = -ids.shape[1] % multiple
            if pad:
                ids, keep = F.pad(ids, (0, pad)), F.pad(keep, (0, pad))
                routed = None if routed is None else F.pad(routed, (0, 0, 0, 0, 0, pad), value=routing.NONE)
            where = None if positions is None else positions(mb)
            kwargs = {"attention_mask": causal_padding_mask(keep)}
        if moe:  # the tokens each router saw: [s/TP * b] under sequence parallelism, [s * b] otherwise
            tokens = ids.numel() // (ps.tp_size if inner.config.sequence_parallel else 1)
            _AUX_SCALE[0] = 1.0 / (tokens * count * ps.dp_size)
        if replays:
            routing.set_targets(replays, routed, inner.config.sequence_parallel, ps.tp_rank, ps.tp_size)
        current[0], current[1] = mb, where

        def on_output(output, non_loss_data=False):
            return loss_fn(mb, output)

        return model(ids, None, **kwargs), on_output

    interleaved = len(chunks) > 1
    with (
        cpu_bridge.device_mode(),
        output_positions(
            inner,
            None if positions is None and not packed else lambda: current[1],
            None if head is None else lambda hidden, weight: head(current[0], hidden, weight),
            packed,
        ),
        _variable_shapes(inner.config, packed or len(shapes) > 1),
        routing.cleared(replays),
    ):
        out = get_forward_backward_func(*((ps.pp_size, len(chunks)) if interleaved else ()))(
            forward_step_func=forward_step,
            # each chunk's forward reads the micro-batches in order from its own iterator
            data_iterator=[iter(microbatches) for _ in chunks] if interleaved else iter(microbatches),
            model=chunks,
            num_microbatches=len(microbatches),
            seq_length=-(-s // multiple) * multiple,  # packed: shapes travel with each activation
            micro_batch_size=1 if packed else b,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )
    return out[:count] if forward_only else out


def broadcast_from_last_stage(tensor: torch.Tensor | None, ps: ParallelState, shape, dtype) -> torch.Tensor:
    """Make a last-stage result (e.g. log-probs [B, T]) available on every pipeline stage."""
    if ps.pp_size == 1:
        return tensor
    tensor = tensor.contiguous() if ps.is_last_stage else torch.empty(shape, dtype=dtype, device=ps.device)
    dist.broadcast(tensor, src=ps.pp_last_rank, group=ps.pp_group)
    return tensor


def gather_tp(x: torch.Tensor, ps: ParallelState, dim: int = -1) -> torch.Tensor:
    """Concatenate TP shards along ``dim`` (tests and diagnostics; never the full vocab in training)."""
    if ps.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ps.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=dim)
