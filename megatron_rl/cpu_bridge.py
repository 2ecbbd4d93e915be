"""What megatron-core 0.16.1 needs to run on a machine without CUDA, in one place.

megatron-core assumes CUDA in three ways that matter for our models and schedules:

1. ``torch.cuda.current_device()`` names the device of new tensors (RoPE tables, p2p buffers, ~60
   sites) and ``torch.cuda.synchronize()`` follows pipeline p2p ops. On CPU we make the first return
   the CPU device and the second a no-op.
2. Factory calls with ``device="cuda"`` or an int device (schedules.py's token counters, the
   tied-embedding ``.cuda()`` in LanguageModule) are redirected to the CPU by :class:`CpuDeviceMode`,
   a TorchFunctionMode entered around model construction and every forward/backward.
3. The CUDA RNG tracker (forked by attention dropout on every forward) is replaced by
   :class:`CpuRNGStatesTracker`, which keeps the same named streams on the CPU generator.
4. megatron's optimizers (``optimizer.py``, ``distrib_optimizer.py``, ``clip_grads.py``) accept
   parameters and gradients by their CUDA type names (``param.type() == "torch.cuda.FloatTensor"``);
   under :class:`CpuDeviceMode` a CPU tensor's ``type()`` answers with the CUDA name of its dtype.
   With that, megatron's DDP, optimizers (distributed one included), ``finalize_model_grads`` and
   their dist_checkpointing state run on CPU as they do on GPU.
5. Activation recompute (``tensor_parallel.checkpoint``) saves and restores the "CUDA" RNG state
   around the recomputed forward (``random._get_cuda_rng_state`` / ``_set_cuda_rng_state``); on CPU
   that state is the CPU generator's, which the tracker of 3. uses too.

6. The MoE alltoall token dispatcher moves its split sizes to the host on a side stream
   (``torch.cuda.Stream``, ``current_stream``, ``stream(...)``, ``record_stream``). On CPU there is
   one stream: :class:`CpuStream` answers those calls, and a tensor's ``record_stream`` is a no-op.
   Its ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` leaves a tensor already on the host as a
   tensor, which ``all_to_all_single`` refuses as split sizes: on CPU it returns the numpy array a
   GPU run gets (:func:`_host_tensor`).

7. ``moe_utils.router_gating_linear`` tests a name (``te_general_gemm``) that megatron-core 0.16.1
   binds only when Transformer Engine is installed; without it the name is bound to None (the plain
   matmul path), on CPU and GPU alike.

8. With TP > 1 the MoE token dispatcher gathers / reduce-scatters a different number of tokens per
   TP rank (``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with split
   sizes), as lists of uneven tensors, which gloo refuses. On CPU the uneven case is an all-gather of
   tensors padded to the largest split (then trimmed), and an all-reduce of which each rank keeps
   its split: the same results.

9. ``multi_latent_attention`` decides whether Transformer Engine is there by importing megatron's TE
   extension, which without TE binds its classes to mocks: ``isinstance(layer, TELinear)`` then
   raises. Without TE the module's flag is set to what is true (no TE), on CPU and GPU alike.

Causal masks are always passed explicitly (``get_default_causal_mask`` allocates on "cuda").
Everything here is inert when CUDA is available; :func:`install` checks the megatron-core version it
was written against and refuses another one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

SUPPORTED_MCORE = "0.16.1"
_installed = False


def _to_cpu_device(device: object) -> object:
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CpuDeviceMode(TorchFunctionMode):
    """Redirects CUDA device arguments of torch calls to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers accept parameters by their CUDA type name ("torch.cuda.FloatTensor").
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func in (torch.Tensor.to,) and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Named RNG streams on the CPU generator, with the interface of megatron's CUDA tracker."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG stream {name!r} / seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class CpuStream:
    """The CPU's one stream behind ``torch.cuda.Stream``'s interface (every wait is already met)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: object = None) -> CpuStream:
        return self  # an event of the one stream: synchronize() and query() as above


def _host_tensor(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors that are already on the host."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _uneven_collectives() -> None:
    """Point 8 of the module docstring."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


def install() -> None:
    """Check the megatron-core version and, without CUDA, patch the two torch.cuda calls it makes."""
    global _installed
    if _installed:
        return
    import megatron.core

    version = getattr(megatron.core, "__version__", None)
    if version != SUPPORTED_MCORE:
        raise RuntimeError(
            f"megatron-rl is written against megatron-core {SUPPORTED_MCORE}, found {version}: "
            f"pip install megatron-core=={SUPPORTED_MCORE}"
        )
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False
    if not torch.cuda.is_available():
        from megatron.core.tensor_parallel import random as mrandom

        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.Stream = CpuStream
        torch.cuda.current_stream = lambda device=None: CpuStream()
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
        torch.Tensor.record_stream = lambda self, stream: None
        from megatron.core.transformer.moe import token_dispatcher

        moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor
        _uneven_collectives()
        mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
            torch.get_rng_state()
        )
        mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
            new_state
        )
    _installed = True


def seed_model_parallel_rng(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Megatron's named RNG streams (data-parallel, tensor-parallel, expert) for this rank."""
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)
        return
    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    # megatron's offsets: expert streams differ by EP and expert-TP rank
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def device_mode() -> contextlib.AbstractContextManager:
    """CpuDeviceMode without CUDA, a no-op context with it."""
    return contextlib.nullcontext() if torch.cuda.is_available() else CpuDeviceMode()
