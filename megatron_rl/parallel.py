"""Process groups: torch.distributed from torchrun's environment, then megatron's TP/PP/DP groups.

:func:`init_parallel` is the one place that starts distributed state. It returns a
:class:`ParallelState` that the rest of the code receives explicitly (no module reads megatron's
global ``parallel_state`` for sizes or ranks except through this object).

Rank order is megatron's default "tp-cp-ep-dp-pp": tensor-parallel ranks are adjacent (same node,
fast links), pipeline stages are furthest apart. Experts of a mixture-of-experts model have a grid of
their own over the same ranks (megatron's "expert" decomposition): expert TP (ETP) x expert parallel
(EP) x expert DP x PP, so that within one pipeline stage EP x ETP ranks share out the experts and the
remaining ``world / (PP x EP x ETP)`` are expert data-parallel copies.

A ParallelState holds megatron's group objects, which megatron destroys when its parallel state is
re-initialized (:func:`init_parallel` again, :func:`destroy_parallel`): each state records the
generation it was built in and :meth:`ParallelState.check_current` refuses a state from an older one.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl import job_secret
from megatron_rl.job_secret import JobSecret


@dataclass
class ParallelState:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup
    """Model-parallel group (TP x PP): every shard of one model replica."""
    embedding_group: dist.ProcessGroup | None
    """First and last pipeline stage, for tied embeddings."""
    ep_size: int = 1
    """Expert-parallel size: experts are distributed whole over this many ranks."""
    ep_rank: int = 0
    etp_size: int = 1
    """Expert tensor-parallel size: each expert's matrices are split over this many ranks."""
    etp_rank: int = 0
    expert_dp_group: dist.ProcessGroup | None = None
    """The ranks holding copies of the same experts (their gradients are reduced over it)."""
    global_rank: int = 0
    """This process's rank in the whole job (``rank`` is its rank in its world: trainer.placement)."""
    job_store: dist.Store | None = None
    """The job's key-value store; set when a role has ranks of its own (roles.transport uses it)."""
    job_secret: JobSecret | None = None
    """The key that signs the roles' messages in ``job_store`` (set with it, read once at start)."""
    generation: int | None = None
    """The :func:`generation` of megatron's parallel state this object was built in (init_parallel sets
    it); None: a hand-built state whose groups this module does not track."""

    @property
    def is_dp_leader(self) -> bool:
        """The first rank of its model replica (TP rank 0 of the first stage): the one that speaks for
        the replica (generates on the transformers engine, scores rewards, posts its prompts)."""
        return self.tp_rank == 0 and self.pp_rank == 0

    def check_current(self) -> None:
        """Raise if megatron's parallel state was destroyed or re-initialized since this state was built:
        its groups are then destroyed ones (collectives on them hang or fail far from the cause)."""
        if self.generation is None:
            return
        from megatron.core import parallel_state as mps

        stale = self.generation != _generation or not mps.model_parallel_is_initialized()
        if not stale:  # megatron re-initialized behind init_parallel's back: its groups are new objects
            stale = mps.get_tensor_model_parallel_group(check_initialized=False) is not self.tp_group
        if stale:
            raise RuntimeError(
                "this ParallelState was built before megatron's parallel state was re-initialized; "
                "rebuild it with megatron_rl.parallel.init_parallel"
            )

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        self.check_current()
        return dist.get_global_rank(self.pp_group, self.pp_size - 1)


_generation = 0
"""Bumped each time megatron's parallel state is initialized or destroyed through this module."""


def generation() -> int:
    """The current generation of megatron's parallel state (see :meth:`ParallelState.check_current`)."""
    return _generation


def _bump_generation() -> None:
    global _generation
    _generation += 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Notices megatron-core prints on import or first use that say nothing about this run: we use its
# local (non-TE, non-Apex) modules on purpose, and CUDA graphs / async TP all-reduce are not used;
# newer torch releases deprecate the collective names megatron-core 0.16.1 calls (sequence parallel).
_KNOWN_NOTICES = (
    r".*(Transformer Engine|Apex).* not installed.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*full scope is deprecated.*",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*",
)


_te_noticed = False


def te_notice() -> str | None:
    """What the hidden Transformer Engine / Apex notices said, in one line; None when Transformer Engine
    is installed. Without it megatron-core's optimizer falls back to Apex's fused Adam or torch's AdamW
    (and local multi-tensor kernels); our layers are megatron-core's local spec either way."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return None
    adam = "Apex's fused Adam" if importlib.util.find_spec("apex") is not None else "torch's AdamW"
    return (
        f"megatron-rl: Transformer Engine not installed: megatron-core runs its local layers and {adam} "
        "(docs/gpu.md)"
    )


def cudnn_libraries() -> set[str]:
    """Paths of the cuDNN libraries mapped into this process, whoever loaded them (Linux)."""
    with open("/proc/self/maps") as maps:
        return {ln.split()[-1] for ln in maps if "/libcudnn" in ln}


def load_torch_cudnn() -> None:
    """Make Transformer Engine use the cuDNN torch was built with; call it before Transformer Engine (or
    megatron-core, which imports it) is imported. A no-op without TE, CUDA or cuDNN, or once TE is
    imported.

    TE's import loads the first cuDNN it finds under ``CUDNN_HOME``, ``CUDNN_PATH``, ``CUDA_HOME`` or
    ``/usr/local/cuda`` (the system's, say) into the process's global namespace, and its core library
    pulls cuDNN's sub-libraries (``libcudnn_heuristic`` ...) from the system's library path; torch
    loads its own bundled cuDNN only on first use, by name. Where the two differ torch gets TE's, and
    refuses it or runs on it (measured: megatron-core's local layers 1.6x slower a pass); with torch's
    loaded first, the two versions' sub-libraries mix and TE's core fails to load. So torch's cuDNN,
    every sub-library of it, is loaded here, and TE is pointed at its directory (``CUDNN_HOME``, unless
    that or ``CUDNN_PATH`` is set already): one cuDNN in the process, torch's (TE needs 9.12 or later)."""
    import importlib.util

    if (
        not (torch.cuda.is_available() and torch.backends.cudnn.is_available())
        or "transformer_engine" in sys.modules
        or importlib.util.find_spec("transformer_engine") is None
    ):
        return
    try:
        torch.backends.cudnn.version()  # loads torch's libcudnn.so
    except RuntimeError as e:  # another cuDNN was loaded before: nothing to steer any more
        warnings.warn(
            f"megatron-rl: torch runs without cuDNN ({str(e).splitlines()[0][:160]}): a cuDNN other than "
            "torch's was loaded before it (set CUDNN_HOME to torch's cuDNN directory)",
            stacklevel=2,
        )
        return
    loaded = {f for f in cudnn_libraries() if os.path.basename(f).startswith("libcudnn.so")}
    if len(loaded) != 1:
        return
    lib_dir = os.path.dirname(loaded.pop())

    def dlopen(path: str) -> bool:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            return False
        return True

    pending = sorted(glob.glob(os.path.join(lib_dir, "libcudnn*.so*")))
    while pending:  # a library whose dependencies are not loaded yet waits for the next round
        failed = [path for path in pending if not dlopen(path)]
        if len(failed) == len(pending):
            break
        pending = failed
    if not (os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH")):
        os.environ["CUDNN_HOME"] = lib_dir


def silence_known_notices(announce: bool = False) -> None:
    """Hide megatron-core's fallback notices (listed above) and its INFO logs; warnings stay visible.

    ``announce`` (rank 0 of a GPU run, the only kind that could use Transformer Engine): print
    :func:`te_notice` in place of the hidden notices, once per process."""
    import logging
    import warnings

    global _te_noticed
    for pattern in _KNOWN_NOTICES:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    line = te_notice() if announce and not _te_noticed else None
    if line is not None:
        _te_noticed = True
        print(line, flush=True)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no GPU is visible: set trainer.device=cpu or auto.")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    seed: int = 42,
    device: str = "auto",
    timeout_minutes: float = 30,
    ranks: tuple[int, ...] | None = None,
    ep: int = 1,
    etp: int | None = None,
) -> ParallelState:
    """Start torch.distributed (nccl on GPU, gloo on CPU) and megatron's groups; seed every stream.

    ``ep`` / ``etp``: expert-parallel and expert tensor-parallel sizes (``etp=None``: TP, megatron's
    default); they only matter for a mixture-of-experts model.

    Launched by torchrun the job comes from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; a plain
    ``python`` process runs as a world of one. ``ranks`` (global ranks, this one among them) makes
    torch.distributed's world those ranks only, so megatron's groups span exactly them: the training
    ranks and the rollout ranks of a separate-rollout placement each get their own world, and reach
    each other through the job's store (``ParallelState.job_store``), signing their messages with the
    job's secret (``ParallelState.job_secret``: ``MEGATRON_RL_JOB_SECRET``, read here once; without it
    those ranks refuse to start, in one line).
    """
    dev = resolve_device(device)
    silence_known_notices(announce=dev.type == "cuda" and int(os.environ.get("RANK", 0)) == 0)
    load_torch_cudnn()  # before megatron-core imports Transformer Engine (which loads a cuDNN of its own)
    from megatron.core import parallel_state as mps

    from megatron_rl import cpu_bridge

    cpu_bridge.install()
    backend = "nccl" if dev.type == "cuda" else "gloo"
    job_rank, job_store, secret = int(os.environ.get("RANK", 0)), None, None
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            # Binding the communicator to the device creates it eagerly, before any rollout engine
            # starts in this process (the engine's own NCCL setup breaks a lazily created one).
            kwargs["device_id"] = dev
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "RANK" not in os.environ:  # one process without a launcher: a world of one, on a free port
            kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        elif ranks is None or len(ranks) == int(os.environ["WORLD_SIZE"]):
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        else:
            secret = job_secret.read()  # before any group starts: every rank refuses alike without it
            store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
            store.set_timeout(timeout)
            job_store = store
            name = "world/" + "-".join(map(str, ranks))
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(name, store),
                rank=ranks.index(job_rank),
                world_size=len(ranks),
                timeout=timeout,
                **kwargs,
            )
    world = dist.get_world_size()
    if world % (tp * pp):
        raise RuntimeError(f"world size {world} is not divisible by TP x PP = {tp} x {pp}")
    etp = tp if etp is None else etp
    if world % (etp * ep * pp):
        raise RuntimeError(
            f"world size {world} is not divisible by expert TP x EP x PP = {etp} x {ep} x {pp}: "
            "set *.megatron.expert_model_parallel_size / expert_tensor_parallel_size so that it is"
        )
    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    _bump_generation()
    mps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=True,
    )
    state = ParallelState(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        device=dev,
        backend=backend,
        tp_size=tp,
        pp_size=pp,
        dp_size=mps.get_data_parallel_world_size(),
        tp_rank=mps.get_tensor_model_parallel_rank(),
        pp_rank=mps.get_pipeline_model_parallel_rank(),
        dp_rank=mps.get_data_parallel_rank(),
        tp_group=mps.get_tensor_model_parallel_group(),
        pp_group=mps.get_pipeline_model_parallel_group(),
        dp_group=mps.get_data_parallel_group(),
        mp_group=mps.get_model_parallel_group(),
        embedding_group=mps.get_embedding_group(check_initialized=False),
        ep_size=ep,
        ep_rank=mps.get_expert_model_parallel_rank(),
        etp_size=etp,
        etp_rank=mps.get_expert_tensor_parallel_rank(),
        expert_dp_group=mps.get_expert_data_parallel_group(),
        global_rank=job_rank,
        job_store=job_store,
        job_secret=secret,
        generation=_generation,
    )
    seed_all(seed, state)
    return state


def seed_all(seed: int, state: ParallelState) -> None:
    """Same seed on every rank for host-side sampling; megatron's TP/DP streams for dropout."""
    state.check_current()
    import random

    import numpy as np

    from megatron_rl import cpu_bridge

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    cpu_bridge.seed_model_parallel_rng(seed, state.tp_rank, state.ep_rank, state.etp_rank)


def destroy_parallel() -> None:
    from megatron.core import parallel_state as mps

    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    _bump_generation()
    if dist.is_initialized():
        dist.destroy_process_group()
