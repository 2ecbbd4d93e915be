"""What the colocated rollout needs parked, decided once before the first step; and the engine's
CUDA-graph batch sizes.

    parts   = state_parts(cfg, trained={"actor": (module, optim), ...}, frozen={"ref": module, ...})
    plan    = plan_offload(parts, need_bytes)          pure: which (model, state) to park
    plan    = plan_memory(cfg, device, trained, frozen) the two above, from the device's free memory
    plan.parks("actor", "optimizer") -> bool           read by the parking before each generation
    plan.log_line(), plan.metrics()                    the decision, once; perf/parked_gb and flags

Sizes are bytes of this rank's tensors (storages counted once): ``params`` a model's parameters,
``grads`` DDP's gradient buffers, ``optimizer`` Adam's moments and the fp32 main weights
(optim.ModelOptimizer.state_tensors, created with the optimizer, so they show before the first step).

Need. Colocated with ``rollout.free_cache_engine`` (the default) the engine hands its memory back while
the models train and takes ``rollout.gpu_memory_utilization x total`` back to generate; the plan is made
when the models are built and the engine's memory is out, so generation needs
``engine + margin - available`` bytes more than the device has, ``available`` being the free device
memory plus torch's cached blocks (emptied before the engine resumes). Without free_cache_engine the
engine never gives its memory back and the models already fit beside it: nothing is needed. On CPU
there is no device budget to read: ``auto`` parks nothing unless a caller (a test) gives one.

Greedy order, cheapest to bring back per byte first: optimizer state (one copy back), gradients (no
copy at all: they are re-zeroed before each update, parked with keep_values=False), frozen parameters
(ref, reward), the critic's parameters, the actor's (parked after the weight sync, which reads them:
they lower the generation's peak, not the sync's); models in the order actor, critic, ref, reward
inside each class. A key set to true/false is obeyed as is (true parks and counts toward the need);
``auto`` ones are parked in that order until the parked bytes cover the need.

CUDA graphs: SGLang replays a captured graph only for decode batches up to its largest captured size.
:func:`cuda_graph_max_bs` sizes that to the rows one engine decodes at once (its share of the batch x
rollout.n), rounded up onto SGLang's capture grid and capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from megatron_rl.config import Config

GB = 1e9
STATES = ("params", "grads", "optimizer")
TRAINED = ("actor", "critic")
FROZEN = ("ref", "reward")
MIN_MARGIN = 1 << 30
"""Bytes always left free at generation (activations of the engine outside its static pool)."""
MARGIN_FRACTION = 0.02
"""... or this share of the device, if larger."""

_SECTIONS = {
    "actor": "actor_rollout_ref.actor.megatron",
    "critic": "critic.megatron",
    "ref": "actor_rollout_ref.ref.megatron",
    "reward": "reward_model.megatron",
}


def _section(cfg: Config, model: str):
    """A model's ``megatron`` section of the config."""
    out = cfg
    for k in _SECTIONS[model].split("."):
        out = getattr(out, k)
    return out


def config_key(model: str, state: str) -> str:
    """The key that forces parking of ``state`` of ``model``: ``critic.megatron.grad_offload``."""
    key = {"params": "param_offload", "grads": "grad_offload", "optimizer": "optimizer_offload"}[state]
    return f"{_SECTIONS[model]}.{key}"


@dataclass(frozen=True)
class Part:
    """One parkable piece of a model's state on this rank."""

    model: str
    """actor | critic | ref | reward"""
    state: str
    """params | grads | optimizer"""
    nbytes: int
    forced: bool | None = None
    """The config key's value when true/false; None when ``auto``."""

    @property
    def name(self) -> str:
        return f"{self.model}.{self.state}"


def _rank(part: Part) -> tuple[int, int]:
    """Greedy order: optimizer, grads, frozen params, the critic's, the actor's; models actor, critic,
    ref, reward."""
    if part.state == "params":
        # the actor's last: parked only after the weight sync, so they never lower the sync's peak
        cls = 2 if part.model in FROZEN else 3 + (part.model == "actor")
    else:
        cls = 0 if part.state == "optimizer" else 1
    return cls, (TRAINED + FROZEN).index(part.model)


@dataclass
class OffloadPlan:
    """Which parts are parked during generation (module docstring)."""

    parts: list[Part]
    parked: set[str] = field(default_factory=set)
    """Names ("actor.optimizer", ...) of the parts to park."""
    need_bytes: int = 0
    """Bytes generation needs beyond what the device has with nothing parked (0: it fits as it is)."""
    budget: str = ""
    """How the need was reached, for the log line."""

    def parks(self, model: str, state: str) -> bool:
        return f"{model}.{state}" in self.parked

    @property
    def parked_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts if p.name in self.parked)

    @property
    def shortfall_bytes(self) -> int:
        """Need left uncovered: even the parts the planner may park do not free enough."""
        return max(0, self.need_bytes - self.parked_bytes)

    def log_line(self) -> str:
        """The decision in one line: what is parked (auto or forced), what stays, whether it fits."""

        def part(p: Part) -> str:
            how = "" if p.forced is None else ", forced"
            return f"{p.name} {p.nbytes / GB:.2f} GB{how}"

        parked = [part(p) for p in sorted(self.parts, key=_rank) if p.name in self.parked]
        kept = [part(p) for p in sorted(self.parts, key=_rank) if p.name not in self.parked]
        line = (
            f"megatron-rl: memory plan: {self.budget or 'no device budget'}; "
            f"park {', '.join(parked) or 'nothing'}; keep {', '.join(kept) or 'nothing'}"
        )
        if self.shortfall_bytes:
            line += (
                f"; short by {self.shortfall_bytes / GB:.2f} GB: set the *.megatron.*_offload keys kept "
                "false to auto, or lower actor_rollout_ref.rollout.gpu_memory_utilization"
            )
        return line

    def metrics(self, parked_bytes: int | None = None) -> dict[str, float]:
        """perf/parked_gb (this rank's parked bytes per generation: ``parked_bytes`` as measured by the
        parking, else the plan's) and perf/offload/<model>_<state> (1 parked, 0 kept) for every part."""
        parked = self.parked_bytes if parked_bytes is None else parked_bytes
        out = {"perf/parked_gb": parked / GB}
        for p in self.parts:
            out[f"perf/offload/{p.model}_{p.state}"] = float(p.name in self.parked)
        return out


def plan_offload(parts: Iterable[Part], need_bytes: int, budget: str = "") -> OffloadPlan:
    """Park the forced-true parts, then ``auto`` ones in the greedy order until ``need_bytes`` are
    covered (pure: no device, no tensors)."""
    parts = sorted(parts, key=_rank)
    plan = OffloadPlan(parts, need_bytes=max(0, int(need_bytes)), budget=budget)
    plan.parked = {p.name for p in parts if p.forced is True}
    for p in parts:
        if plan.parked_bytes >= plan.need_bytes:
            break
        if p.forced is None and p.nbytes:
            plan.parked.add(p.name)
    return plan


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors`` (a storage shared by views counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _forced(value) -> bool | None:
    return None if value == "auto" else bool(value)


def state_parts(
    cfg: Config, trained: dict[str, tuple], frozen: dict[str, torch.nn.Module | None]
) -> list[Part]:
    """The parts of this rank's models: ``trained`` name -> (module, optimizer with state_tensors() and
    grad_tensors()), ``frozen`` name -> module; a None module (not on these ranks) has no parts."""
    parts = []
    for name, (module, optim) in trained.items():
        if module is None:
            continue
        mcfg = _section(cfg, name)
        sizes = {
            "params": tensor_bytes(module.parameters()),
            "grads": tensor_bytes(optim.grad_tensors()),
            "optimizer": tensor_bytes(optim.state_tensors()),
        }
        forced = {
            "params": mcfg.param_offload,
            "grads": mcfg.grad_offload,
            "optimizer": mcfg.optimizer_offload,
        }
        parts += [Part(name, s, sizes[s], _forced(forced[s])) for s in STATES]
    for name, module in frozen.items():
        if module is not None:
            mcfg = _section(cfg, name)
            parts.append(Part(name, "params", tensor_bytes(module.parameters()), _forced(mcfg.param_offload)))
    return parts


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(available, total) bytes of a GPU: free memory plus torch's cached, unallocated blocks (the
    parking empties the cache before the engine resumes); None on CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, total


def generation_need(cfg: Config, available: int, total: int, margin: int | None = None) -> tuple[int, str]:
    """Bytes generation needs beyond ``available`` (module docstring), and how, in words."""
    rollout = cfg.actor_rollout_ref.rollout
    engine = int(rollout.gpu_memory_utilization * total) if rollout.free_cache_engine else 0
    if margin is None:
        margin = max(MIN_MARGIN, int(MARGIN_FRACTION * total))
        margin += rollout.update_weights_bucket_megabytes << 20  # a weight-sync bucket in flight
    need = max(0, engine + margin - available)
    how = (
        f"{available / GB:.2f} GB available (the training passes' activations have this), "
        f"engine {engine / GB:.2f} GB + margin {margin / GB:.2f} GB"
        f" -> {need / GB:.2f} GB to free"
    )
    return need, how


def plan_memory(
    cfg: Config,
    device: torch.device,
    trained: dict[str, tuple],
    frozen: dict[str, torch.nn.Module | None],
    available: int | None = None,
    total: int | None = None,
    margin: int | None = None,
    log: Callable[[str], object] | None = None,
) -> OffloadPlan:
    """The run's plan, from this rank's tensors and the device's memory (``available``/``total``
    replace the device's reading: a CPU run or a test gives them; without them a CPU run needs
    nothing). Call it with the models and optimizers built and the engine's memory released;
    ``log`` (rank 0's print) gets :meth:`OffloadPlan.log_line`."""
    parts = state_parts(cfg, trained, frozen)
    mem = (available, total) if available is not None and total is not None else device_memory(device)
    if mem is None:
        plan = plan_offload(parts, 0, "CPU, no device budget")
    else:
        plan = plan_offload(parts, *generation_need(cfg, mem[0], mem[1], margin))
    if log is not None:
        log(plan.log_line())
    return plan


def config_plan(cfg: Config, trained: Iterable[str] = TRAINED, frozen: Iterable[str] = FROZEN) -> OffloadPlan:
    """The keys alone (no sizes): true parks, false and ``auto`` keep -- what runs when no plan was made."""
    parts = []
    for name in trained:
        mcfg = _section(cfg, name)
        forced = {
            "params": mcfg.param_offload,
            "grads": mcfg.grad_offload,
            "optimizer": mcfg.optimizer_offload,
        }
        parts += [Part(name, s, 0, _forced(forced[s])) for s in STATES]
    for name in frozen:
        parts.append(Part(name, "params", 0, _forced(_section(cfg, name).param_offload)))
    return plan_offload(parts, 0, "the *_offload keys alone")


# --------------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------------

CUDA_GRAPH_MAX_BS_CAP = 1024
"""Largest decode batch captured: each captured size costs start-up time and graph memory."""


def sglang_capture_grid(bs: int) -> int:
    """``bs`` rounded up onto SGLang's default capture sizes (1, 2, 4, 8, 12, 16..256 step 8,
    272..496 step 16, 512.. step 32), so that the largest size asked for is itself captured."""
    if bs <= 8:
        return 1 << max(0, math.ceil(math.log2(max(bs, 1))))
    if bs <= 12:
        return 12
    for top, step in ((256, 8), (512, 16)):
        if bs <= top:
            return min(top, -(-bs // step) * step)
    return 512 + -(-(bs - 512) // 32) * 32


def cuda_graph_max_bs(cfg: Config, engines: int, cap: int = CUDA_GRAPH_MAX_BS_CAP) -> int:
    """The largest decode batch to capture for an engine of ``engines`` (each samples its share of
    data.train_batch_size prompts x rollout.n; validation batches too when data.val_batch_size is set),
    on SGLang's grid and at most ``cap``. With rollout.data_parallel_size > 1 each attention group of an
    engine decodes its share and captures its own graphs: count the groups (ranks / rollout TP)."""
    if engines < 1:
        raise ValueError(f"cuda_graph_max_bs: engines={engines} must be >= 1")
    rollout = cfg.actor_rollout_ref.rollout
    rows = -(-cfg.data.train_batch_size // engines) * rollout.n
    if cfg.data.val_batch_size:
        rows = max(rows, -(-cfg.data.val_batch_size // engines) * rollout.val_kwargs.n)
    return min(sglang_capture_grid(rows), sglang_capture_grid(cap))
