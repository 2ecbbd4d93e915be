"""Starting SGLang inside a trainer rank: the engine's arguments for a rollout config
(:func:`engine_arguments`); ``sglang.Engine`` spawns its scheduler and detokenizer processes from this
process, so torchrun's variables are hidden while it starts, tqdm gets a thread lock, SGLang's argument
dump goes to DEBUG and one summary line is logged (:func:`start_sglang`); :func:`child_pids` lets the
engine tell its worker processes from the rank's other children."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from megatron_rl.rollout.sglang_loader import LOADER, READ_BACK

log = logging.getLogger(__name__)


def engine_arguments(
    cfg, model_path: str, tp_size: int, base_gpu_id: int, seed: int, cuda_graph_max_bs: int | None = None
) -> dict:
    """``sglang.Engine`` keyword arguments for a rollout config (``actor_rollout_ref.rollout.*``): the
    trainer's engine and bench/rollout.py's standalone one start from the same dict. ``tp_size``: the
    ranks the engine spans (rollout.engine_ranks: with rollout.data_parallel_size D > 1 SGLang's TP is
    over all of them, its attention in D groups, "DP attention"). ``cuda_graph_max_bs``: the largest
    decode batch to capture (run.memory_plan.cuda_graph_max_bs: the rows the engine decodes at once);
    None: 256."""
    kwargs = dict(
        model_path=model_path,
        load_format="dummy",  # weights come from the reshard stream
        skip_tokenizer_init=True,
        tp_size=tp_size,
        base_gpu_id=base_gpu_id,
        dtype=cfg.dtype,
        mem_fraction_static=cfg.gpu_memory_utilization,
        chunked_prefill_size=cfg.max_num_batched_tokens,
        max_prefill_tokens=cfg.max_num_batched_tokens,
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        enable_memory_saver=True,
        disable_cuda_graph=not cfg.enable_cuda_graph,
        random_seed=seed % 2**31,  # SGLang seeds numpy with it, which takes [0, 2**32) only
        log_level="error",
        # MoE buckets: experts copied into the fused weights; the sync check's read-back (sglang_loader)
        custom_weight_loader=[LOADER, READ_BACK],
    )
    if cfg.data_parallel_size > 1:  # one engine of tp_size ranks, attention in DP groups within it
        kwargs.update(dp_size=cfg.data_parallel_size, enable_dp_attention=True)
    if cfg.expert_parallel_size > 1:  # each rank a contiguous block of experts (sglang_loader)
        kwargs["ep_size"] = cfg.expert_parallel_size
    if cfg.enable_cuda_graph:
        # Larger decode batches run without graphs; each captured size costs start-up time.
        kwargs["cuda_graph_max_bs_decode"] = cuda_graph_max_bs or 256
    return kwargs


# torchrun's variables; SGLang's own process setup must not see them (it would join our world).
_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_ENV_LOCK = threading.RLock()  # one engine start at a time edits os.environ
_SGLANG_ENGINE_LOGGER = "sglang.srt.entrypoints.engine"  # logs every ServerArgs field at INFO


@contextlib.contextmanager
def torchrun_env_hidden() -> Iterator[None]:
    """torchrun's variables (above, and TORCHELASTIC_*) removed from os.environ inside, restored after.

    Why process-wide: ``sglang.Engine`` starts its scheduler and detokenizer processes with
    multiprocessing's spawn, which copies this process's environment and takes no env of its own. A
    child that saw TORCHELASTIC_USE_AGENT_STORE=True would not host the store of its own
    torch.distributed group (torch expects torchrun's agent to) and hang at start; RANK, WORLD_SIZE and
    MASTER_* would point any env:// set-up at the trainer's world. The edit lasts for the
    whole ``sglang.Engine(...)`` call (spawn and readiness wait are one call), so every reader of these
    variables in the project reads them before an engine starts (train.py and parallel.init_parallel
    at start-up; run/explain.py keeps their start-up values) and the lock keeps two starts apart.
    """
    with _ENV_LOCK:
        saved = {k: v for k, v in os.environ.items() if k in _TORCHRUN_VARS or k.startswith("TORCHELASTIC_")}
        for k in saved:
            del os.environ[k]
        try:
            yield
        finally:
            os.environ.update(saved)


class ServerArgsToDebug(logging.Filter):
    """On SGLang's engine logger: its ``server_args=ServerArgs(...)`` record (every field, about 15 kB on
    one INFO line, at each start) goes to our logger at DEBUG instead; any other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("server_args="):
            return True
        log.debug("SGLang's engine arguments: %s", message)
        return False


@contextlib.contextmanager
def server_args_at_debug() -> Iterator[None]:
    """:class:`ServerArgsToDebug` on SGLang's engine logger inside, removed after (nothing else in the
    logging configuration changes)."""
    logger = logging.getLogger(_SGLANG_ENGINE_LOGGER)
    demote = ServerArgsToDebug()
    logger.addFilter(demote)
    try:
        yield
    finally:
        logger.removeFilter(demote)


def engine_summary(model: str, kwargs: dict) -> str:
    """One line of the ``sglang.Engine`` arguments that decide its speed and memory (the rest are
    logged at DEBUG)."""
    graphs = (
        "off" if kwargs.get("disable_cuda_graph") else f"up to batch {kwargs.get('cuda_graph_max_bs_decode')}"
    )
    return (
        f"SGLang engine: model {model}, TP={kwargs.get('tp_size', 1)}{_dp_ep(kwargs)}, "
        f"dtype={kwargs.get('dtype')}, "
        f"mem_fraction_static={kwargs.get('mem_fraction_static')}, CUDA graphs {graphs}, "
        f"attention_backend={kwargs.get('attention_backend')}"
    )


def _dp_ep(kwargs: dict) -> str:
    """ ", DP attention=2, EP=4" for the summary line; "" at 1 and 1."""
    dp, ep = kwargs.get("dp_size", 1), kwargs.get("ep_size", 1)
    return (f", DP attention={dp}" if dp > 1 else "") + (f", EP={ep}" if ep > 1 else "")


def progress_bars_thread_locked() -> None:
    """Give tqdm a thread lock, so that no progress bar of this process creates tqdm's default
    multiprocessing lock.

    Why: that lock is a named semaphore. Once ``sglang.Engine`` has made spawn the start method, a new
    one is registered with multiprocessing's resource tracker, a child process of ours; the engine's
    shutdown kills every child process, the tracker included, and at exit the semaphore's clean-up
    reaches a relaunched tracker that never saw it: "KeyError: '/loky-...'" (named so when joblib,
    imported by scikit-learn through transformers, renamed multiprocessing's semaphores). The bars here
    (the trainer's step bar, loading bars) are drawn by threads of this process only."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def start_sglang(kwargs: dict, model: str) -> Any:
    """``sglang.Engine(**kwargs)`` in this process, with torchrun's variables hidden
    (:func:`torchrun_env_hidden`), one summary line logged and SGLang's argument dump at DEBUG.
    ``model``: what the summary names (the engine itself reads a temporary config directory)."""
    import sglang

    progress_bars_thread_locked()
    log.info(engine_summary(model, kwargs))
    with torchrun_env_hidden(), server_args_at_debug():
        return sglang.Engine(**kwargs)


def child_pids() -> set[int]:
    """The pids of every live descendant of this process."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}
