"""Router metrics of a mixture-of-experts model over one update: aux loss, z-loss, expert load.

:class:`RouterStats` is entered around a training phase. It hooks every ``TopKRouter`` (its output
``routing_map`` [tokens, E] bool says which experts each token went to) and counts tokens per expert
and layer; the aux loss and z-loss values come from megatron's own tracker
(``moe_utils.get_moe_layer_wise_logging_tracker``, filled by the router when its loss is on; the
values are the unscaled losses, summed over the router's calls). On exit, :meth:`metrics` gives, the
same on every rank:

* ``<prefix>/moe_aux_loss``, ``<prefix>/moe_z_loss``: mean over MoE layers and router calls (only when
  the coefficient is > 0);
* ``<prefix>/moe_load_imbalance``: max / mean tokens per expert of each layer (1 = perfectly balanced,
  E / top_k = every token on the same experts), counted over the whole data-parallel batch, mean over
  the MoE layers.

A dense model gets an empty dict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.parallel import ParallelState


class RouterStats:
    def __init__(self, model: nn.Module, ps: ParallelState, prefix: str = "actor") -> None:
        self.model, self.ps, self.prefix = model, ps, prefix
        self.active = bool(getattr(getattr(model, "args", None), "is_moe", False))
        self._hooks: list = []
        self.counts: dict[int, torch.Tensor] = {}  # layer number -> [E] tokens (this rank's)
        self.calls: dict[int, int] = {}

    def __enter__(self) -> RouterStats:
        if not self.active:
            return self
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.moe.router import TopKRouter

        # megatron's tracker is process-global and clear_aux_losses_tracker keeps the names: a model
        # trained before with a router loss on would make this one report it (at 0) without one
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
        for mod in self.model.modules():
            if isinstance(mod, TopKRouter):
                self._hooks.append(mod.register_forward_hook(self._count))
        return self

    def _count(self, router: nn.Module, inputs, output) -> None:
        if not router.training:  # activation recompute and eval forwards are not the update's load
            return
        _, routing_map = output
        n = router.layer_number
        tokens = routing_map.detach().sum(dim=0).to(torch.float64)
        self.counts[n] = self.counts.get(n, 0) + tokens
        self.calls[n] = self.calls.get(n, 0) + 1

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def metrics(self) -> dict[str, float]:
        """Collective over the model's ranks (every rank calls it after the phase)."""
        if not self.active:
            return {}
        from megatron.core.transformer.moe import moe_utils

        ps, dev = self.ps, self.ps.device
        layers = sorted(self.counts)
        spread = torch.zeros(2, dtype=torch.float64, device=dev)  # [sum of max/mean, MoE layers]
        if layers:
            counts = torch.stack([self.counts[n] for n in layers]).to(dev)  # [L_stage, E]
            if self.model.config.sequence_parallel:  # each TP rank routed its own slice of the tokens
                dist.all_reduce(counts, group=ps.tp_group)
            if ps.dp_size > 1:  # the whole batch: DP ranks (EP ranks among them) routed different data
                dist.all_reduce(counts, group=ps.dp_group)
            mean = counts.mean(dim=1).clamp(min=1e-12)
            spread[0] = (counts.max(dim=1).values / mean).sum()
            spread[1] = len(layers)
        calls = torch.zeros(1, dtype=torch.float64, device=dev)
        calls[0] = max(self.calls.values(), default=0)
        if ps.pp_size > 1:
            dist.all_reduce(spread, group=ps.pp_group)
            dist.all_reduce(calls, group=ps.pp_group, op=dist.ReduceOp.MAX)
        out = {f"{self.prefix}/moe_load_imbalance": (spread[0] / spread[1].clamp(min=1)).item()}
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        names = [n for n in ("load_balancing_loss", "z_loss") if n in tracker]
        if names:
            moe_utils.reduce_aux_losses_tracker_across_ranks(names)
            for name in names:  # megatron averages over DP only the losses it reduces over a group
                entry = tracker[name]
                if ps.dp_size > 1 and entry.get("reduce_group") is None and entry.get("avg_group") is None:
                    dist.all_reduce(entry["values"], group=ps.dp_group)
                    entry["values"] /= ps.dp_size
            per_call = max(calls.item(), 1.0)
            for name, key in (("load_balancing_loss", "moe_aux_loss"), ("z_loss", "moe_z_loss")):
                if name in tracker:
                    values = tracker[name]["values"]
                    out[f"{self.prefix}/{key}"] = (values.sum() / per_call / max(spread[1].item(), 1)).item()
            moe_utils.clear_aux_losses_tracker()
        return out
