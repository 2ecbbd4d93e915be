"""Grouped-GEMM experts for megatron-core's ``MoELayer``: all of a rank's experts in one matmul per
projection.

The token dispatcher hands the experts their tokens sorted by local expert
(``permuted_local_hidden_states`` [N, H], ``tokens_per_expert`` [E_local]). megatron's
``SequentialMLP`` then runs one small MLP per expert from Python (2 GEMM launches per expert, forward
and backward, for every micro-batch of every pass); :class:`GroupedExperts` runs
``torch.nn.functional.grouped_mm`` over the same rows instead: one launch per projection whatever
the expert count, on CPU and GPU, in fp32, bf16 and fp16.

Weights are stacked per projection, each expert's slice in the layout ``SequentialMLP`` gives it:

* ``weight1`` [E_local, 2F/ETP, H]: expert ``j``'s ``linear_fc1.weight``, [gate; up] rows of this
  expert-TP rank;
* ``weight2`` [E_local, H, F/ETP]: expert ``j``'s ``linear_fc2.weight``.

So a checkpoint does not know which module wrote it: :meth:`sharded_state_dict` emits the keys,
global shapes and shard offsets of ``SequentialMLP`` (``...experts.experts.linear_fc{1,2}.weight``,
experts on the leading axis), and :meth:`expert_views` names each expert's slice as the layout
tables do (``local_experts.{j}.linear_fc1.weight``) for loading, the weight stream and ckpt_tools.
The expert-parallel and expert-TP communication stays in the dispatcher, as for ``SequentialMLP``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ w[e] [in, out] for each expert's rows -> [N, out]."""
    y = F.grouped_mm(x, w, offs=offs)
    if y.requires_grad:
        # grouped_mm's backward rejects a broadcast gradient (stride 0, as from a sum): make it dense
        y.register_hook(torch.Tensor.contiguous)
    return y


class GroupedExperts(MegatronModule):
    """A rank's routed experts (SwiGLU or plain activation, no biases) as two grouped matmuls."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None) -> None:
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError("GroupedExperts holds no expert biases (add_bias_linear=False)")
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp  # the expert-TP group shards the FFN width
        self.dp_group = pg_collection.expt_dp  # replicas of these experts (checkpoint replica ids)
        etp = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size
        if ffn % etp:
            raise ValueError(f"moe_ffn_hidden_size={ffn} is not divisible by the expert TP size {etp}")
        fc1_rows = (2 if config.gated_linear_unit else 1) * ffn // etp
        kw = dict(dtype=config.params_dtype)
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, fc1_rows, config.hidden_size, **kw))
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, config.hidden_size, ffn // etp, **kw)
        )
        expert_parallel = config.expert_model_parallel_size > 1
        for w in (self.weight1, self.weight2):
            # As megatron's expert linears: reduced over the expert-data-parallel group, not all of DP.
            w.allreduce = not expert_parallel

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs
    ):
        """x [N, H] sorted by local expert, tokens_per_expert [E_local], probs [N] -> ([N, H], None)."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), torch.ones_like(probs)
        # grouped_mm's group boundaries: the end row of each expert's tokens, int32 on x's device.
        offs = torch.cumsum(tokens_per_expert.to(device=x.device), 0, dtype=torch.int32)
        lora = getattr(self, "lora", None)  # models.lora.ExpertAdapters: each expert's adapters
        h = _grouped_mm(x, self.weight1.transpose(1, 2), offs)  # [N, 2F/ETP]
        if lora is not None and lora.enabled:
            h = h + lora(x, offs, 1)
        a = self._activation(h)
        a = (a * probs.unsqueeze(-1)).to(x.dtype)  # the router's weight, applied as MLP's per_token_scale
        out = _grouped_mm(a, self.weight2.transpose(1, 2), offs)  # [N, H]
        if lora is not None and lora.enabled:
            out = out + lora(a, offs, 2)
        return out, None

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """megatron's unfused MLP activation (its GLU with the optional clamp and linear offset)."""
        cfg = self.config
        if not cfg.gated_linear_unit:
            return cfg.activation_func(h)
        gate, linear = torch.chunk(h, 2, dim=-1)
        if (val := cfg.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(max=val), linear.clamp(min=-val, max=val)
        return cfg.activation_func(gate) * (linear + cfg.glu_linear_offset)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""

    def expert_views(self) -> dict[str, torch.Tensor]:
        """Each local expert's weights as views, under SequentialMLP's local names, carrying the
        tensor-parallel marks of a SequentialMLP weight (the stacked weight's, one axis less)."""
        out = {}
        for j in range(self.num_local_experts):
            for name, w in (("linear_fc1", self.weight1), ("linear_fc2", self.weight2)):
                view = w[j]
                if hasattr(w, "tensor_model_parallel"):
                    view.tensor_model_parallel = w.tensor_model_parallel
                    view.partition_dim = w.partition_dim - 1 if w.partition_dim >= 0 else -1
                    view.partition_stride = w.partition_stride
                out[f"local_experts.{j}.{name}.weight"] = view
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """SequentialMLP's checkpoint entries (same keys, global shapes and offsets), built from the
        stacked weights: ``{prefix}experts.linear_fc1.weight`` [E, 2F, H] and ``...fc2.weight`` [E, H, F].
        Each ShardedTensor (or factory) holds the parameter itself, so megatron's optimizer maps its
        states to the same keys."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError("GroupedExperts: singleton_local_shards checkpoints are not written")
        ep, ep_rank = self.ep_group.size(), self.ep_group.rank()
        etp, etp_rank = self.tp_group.size(), self.tp_group.rank()
        axis = len(sharded_offsets)  # the experts axis: first axis of the local tensors
        replica_id = (0, 0, self.dp_group.rank())
        experts = (axis, ep_rank, ep)

        def sharded(key: str, t: torch.Tensor, *offsets) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(
                key, t, *sharded_offsets, experts, *offsets, replica_id=replica_id, prepend_axis_num=axis
            )

        fc1_key, fc2_key = f"{prefix}experts.linear_fc1.weight", f"{prefix}experts.linear_fc2.weight"
        out = {f"{prefix}weight2": sharded(fc2_key, self.weight2, (axis + 2, etp_rank, etp))}
        lora = getattr(self, "lora", None)
        if lora is not None:  # expert TP is 1 with adapters (models.lora): whole matrices per expert
            for name, t in lora.named_parameters():
                out[f"{prefix}lora.{name}"] = sharded(f"{prefix}experts.lora.{name}", t)
        if not self.config.gated_linear_unit:
            out[f"{prefix}weight1"] = sharded(fc1_key, self.weight1, (axis + 1, etp_rank, etp))
            return out

        # SwiGLU: the global fc1 is [gate (all ETP shards); up (all ETP shards)], so this rank's gate
        # rows are fragment etp_rank and its up rows fragment etp + etp_rank of 2 * ETP (megatron's
        # apply_swiglu_sharded_factory, with the experts axis in front).
        @torch.no_grad()
        def build(key, t, replica_id, flattened_range):
            gate, up = (c.contiguous() for c in torch.chunk(t, 2, dim=1))
            return [
                sharded(key, gate, (axis + 1, etp_rank, 2 * etp)),
                sharded(key, up, (axis + 1, etp + etp_rank, 2 * etp)),
            ]

        @torch.no_grad()
        def merge(sub_state_dict):
            return torch.cat(sub_state_dict, dim=1)

        out[f"{prefix}weight1"] = ShardedTensorFactory(fc1_key, self.weight1, build, merge, replica_id)
        return out
