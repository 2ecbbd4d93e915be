"""Writing an optimizer step's fp32 main weights into a bf16/fp16 model: rounded to nearest or
stochastically, the changed elements counted.

megatron's mixed-precision optimizers step fp32 main copies of the parameters (this rank's shard of
them with the distributed optimizer), then copy them into the model (``_copy_main_params_to_model_params``).
:class:`MainToModel` replaces that copy on each of megatron's optimizers
(:class:`megatron_rl.optim.ModelOptimizer` installs it; fp32 models train their own parameters and
have no copy):

    fp32 main --(stochastic_round, or .to(dtype))--> model memory: the bf16/fp16 parameter, or with the
                                                     distributed optimizer this rank's shard of it in
                                                     DDP's parameter buffer (all-gathered over DP after)
    elements changed / elements written  --------->  pop_update_fraction (actor|critic/param_update_frac)

Why stochastic: an RL-sized Adam step (~lr, e.g. 5e-6) is below half a bf16 ulp for most weights (ulp/2
of 0.02 is 6e-5): rounded to nearest, the parameter does not move at all and the policy (and the engine,
which receives these parameters) learns only from the few large updates. Stochastic rounding rounds up
with probability (distance to the lower value / ulp): unbiased, so small updates move the parameter on
average.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rl import seeds

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
"""(fp32 main tensor, the model memory it is copied into), one per low-precision parameter."""


class MainToModel:
    """The copy of the fp32 mains into the model, seeded by (run seed, ``key``, step) when stochastic,
    and the count of the elements it changed (see the module docstring)."""

    def __init__(self, stochastic: bool, seed: int, key: str, device: torch.device) -> None:
        """``seed``: the run's seed; ``key``: the optimizer's config section (each role rounds with its
        own noise); ``device``: where the counts are kept (the parameters')."""
        self.stochastic, self.seed, self.key, self.device = stochastic, seed, key, device
        self._changed = torch.zeros((), dtype=torch.float64, device=device)
        self._elements = torch.zeros((), dtype=torch.float64, device=device)

    def install(self, sub, step: Callable[[], int]) -> None:
        """Replace the main-to-model copy of ``sub`` (one of megatron's optimizers) by :meth:`copy`;
        ``step()``: the number of the optimizer step being taken (the noise's seed)."""
        pairs = main_to_model_pairs(sub)
        sub._copy_main_params_to_model_params = lambda: self.copy(pairs, step())

    @torch.no_grad()
    def copy(self, pairs: Pairs, step: int) -> None:
        """fp32 main weights -> bf16/fp16 model memory, rounded to nearest or stochastically.

        The noise stream is seeded by (run seed, key, step): a resumed run rounds as the uninterrupted
        one did. Replicas walk the same parameters in the same order, so TP and DP replicas of a
        parameter draw the same noise and round alike; with the distributed optimizer each DP rank
        rounds only its own shard (other elements), and the all-gather that follows copies the rounded
        bits, so the replicas stay bit-identical."""
        gen = None
        if self.stochastic:
            stream = seeds.derive(seeds.ROUNDING, self.seed, self.key, step)
            gen = torch.Generator(device=self.device).manual_seed(stream)
        for main, model in pairs:
            new = stochastic_round(main, model.dtype, gen) if gen is not None else main.to(model.dtype)
            self._changed += (new != model).sum()
            self._elements += model.numel()
            model.copy_(new)

    def pop_update_fraction(self) -> float | None:
        """Fraction of the low-precision parameter elements that changed value in the steps since the
        last call (over all ranks; None for fp32 models). Collective over the whole job."""
        counts = torch.stack([self._changed, self._elements])
        dist.all_reduce(counts)
        self._changed.zero_()
        self._elements.zero_()
        changed, total = counts.tolist()
        return changed / total if total else None


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """fp32 ``x`` -> bf16, rounded up or down at random in proportion to the distance (unbiased).

    bf16 is fp32's upper 16 bits: add uniform noise in [0, 2^16) to the lower 16 bits, then truncate.
    The int32 view of a float is sign-magnitude, so the same works for negative values. fp16 (other
    exponent range) is rounded to nearest.
    """
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=gen)
    return ((bits + noise) & -65536).view(torch.float32).to(dtype)  # exact: the low bits are zero


def main_to_model_pairs(sub) -> Pairs:
    """(fp32 main tensor, model memory it is copied into) for each low-precision parameter of one of
    megatron's optimizers: the whole parameter, or with the distributed optimizer this rank's shard of
    it in DDP's parameter buffer (all-gathered over DP after the copy)."""
    if hasattr(sub, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        pairs = []
        for mains, params in zip(sub.shard_fp32_from_float16_groups, sub.model_float16_groups, strict=True):
            for main, param in zip(mains, params, strict=True):
                world = sub._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                buf, _, bucket = sub.model_param_gbuf_map[param]
                view = sub.buffers[buf].buckets[bucket].param_data.view(-1)[world.start : world.end]
                pairs.append((main, view))
        return pairs
    mains = [m for group in sub.fp32_from_float16_groups for m in group]
    params = [p for group in sub.float16_groups for p in group]
    return list(zip(mains, params, strict=True))
