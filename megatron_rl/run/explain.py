"""One-line explanations of the ways a distributed run fails, on the rank that failed.

A failed multi-process job prints hundreds of lines (one traceback per rank, torchrun's summary, NCCL
dumps) while the cause fits in one. The trainer runs every rank inside :func:`explain_failures`::

    with explain_failures():
        ...                               # load_config, preflight, init_parallel, Trainer(cfg, ps).fit()

An exception that :func:`explain` recognises becomes ``megatron-rl error: <line>`` on stderr (and in
torchrun's error file, so torchrun's failure summary shows the same line) and the rank exits with
status 1; anything else propagates unchanged with its traceback.

One rule table (:data:`_RULES`, regex -> message) serves exceptions and log lines alike: the launcher's
explanation of a node's log (:func:`megatron_rl.run.launch_checks.explain_log`) goes through
:func:`explain_line`. Nothing here imports torch at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, overload

from megatron_rl.config import ConfigError, DataError
from megatron_rl.errors import COLLATERAL, LaunchError
from megatron_rl.run.ports import busy_port_message

# torchrun's variables as this module first saw them (train.py imports it before anything starts): a
# rollout engine hides them from os.environ while it starts (rollout/sglang_start.torchrun_env_hidden),
# and a failure in that window must still name the right rank, GPU, port and error file.
_LAUNCH_ENV = {
    k: os.environ[k]
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE")
    if k in os.environ
}


@overload
def _env(key: str) -> str | None: ...
@overload
def _env(key: str, default: str) -> str: ...
def _env(key: str, default: str | None = None) -> str | None:
    """os.environ[key], else its value at start-up (see _LAUNCH_ENV), else ``default``."""
    return os.environ.get(key, _LAUNCH_ENV.get(key, default))


def _speaking_rank() -> str | None:
    """This process's rank: torch.distributed's once it is initialized, torchrun's RANK before that."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return _env("RANK")


PREFIX = "megatron-rl error: "
"""Start of the one line a rank prints for an explained failure (``explain-log`` looks for it)."""


def no_gpu_for_local_rank(rank: Any, local_rank: Any, count: Any) -> str:
    return (
        f"rank {rank} (local rank {local_rank}) on {socket.gethostname()} has no GPU: the node shows {count} "
        "GPU(s) but more processes were started per node: start at most one process per GPU "
        "(launch/torchrun.sh --nproc / NPROC_PER_NODE, torchrun --nproc_per_node) or check "
        "CUDA_VISIBLE_DEVICES."
    )


@dataclasses.dataclass
class _Ctx:
    rank: str | None
    """Global rank that failed, when known."""
    op: str | None
    """torch.distributed call that failed (all_reduce, broadcast, init_process_group, ...)."""
    where: str | None
    """Innermost project frame of the failure (file:line in function)."""


TIMEOUT_KEY = "trainer.dist_timeout_minutes"
"""The config key of the collective timeout, named in timeout messages."""


def _duration(ms: str | int) -> str:
    ms = int(ms)
    return f"{ms / 60000:g} min" if ms >= 60000 else f"{ms / 1000:g} s"


def _in(ctx: _Ctx) -> str:
    op = ctx.op or "a collective"
    return f"{op} ({ctx.where})" if ctx.where else op


def _rank(ctx: _Ctx) -> str:
    return f"rank {ctx.rank}" if ctx.rank is not None else "a rank"


def _timeout(ctx: _Ctx, ms: str | int) -> str:
    return (
        f"{_rank(ctx)} timed out in {_in(ctx)} after {_duration(ms)}: likely a rank died or is stuck; "
        "see its log (the first rank that failed holds the cause); if the step is legitimately that slow, "
        f"raise {TIMEOUT_KEY}."
    )


_A, _REF, _C = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"
_OOM_IN_PASS = {
    # phase -> (micro-batch key, its token budget under use_dynamic_bsz, recompute key or None)
    "update_actor": (
        f"{_A}.ppo_micro_batch_size_per_gpu",
        f"{_A}.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
    ),
    "update_critic": (
        f"{_C}.ppo_micro_batch_size_per_gpu",
        f"{_C}.ppo_max_token_len_per_gpu",
        f"{_C}.model.enable_gradient_checkpointing",
    ),
    "old_log_prob": (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        None,
    ),
    "ref": (f"{_REF}.log_prob_micro_batch_size_per_gpu", f"{_REF}.log_prob_max_token_len_per_gpu", None),
    "values": (f"{_C}.ppo_micro_batch_size_per_gpu", f"{_C}.forward_max_token_len_per_gpu", None),
}
"""The trainer's passes: every model's state is on the GPU there (the *_offload keys park state for
generation only: roles/models.park_for_generation), so smaller micro-batches, recompute or more model
parallelism is what helps."""


def _oom(ctx: _Ctx, m: re.Match) -> str:
    sizes = ""
    if m["want"]:
        sizes = f" (wanted {m['want']}" + (f", {m['free']} free of {m['total']}" if m["free"] else "") + ")"
    phase = f" in phase {m['phase']}" if m["phase"] else ""
    head = f"{_rank(ctx)} ran out of GPU memory{phase}{sizes}: "
    if m["phase"] in _OOM_IN_PASS:
        micro, tokens, recompute = _OOM_IN_PASS[m["phase"]]
        return head + (
            f"lower {micro} ({tokens} under use_dynamic_bsz)"
            + (f", set {recompute}=true" if recompute else "")
            + " or raise *.megatron.tensor_model_parallel_size (every model's); the *_offload keys free "
            "memory for generation only."
        )
    return head + (
        "lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu / *.log_prob_micro_batch_size_per_gpu or "
        "actor_rollout_ref.rollout.gpu_memory_utilization; keep rollout.free_cache_engine=True and turn on "
        "*.megatron.param_offload / grad_offload / optimizer_offload; or raise "
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size."
    )


def _init_timeout(ctx: _Ctx, ms: str | int) -> str:
    ctx = dataclasses.replace(ctx, op=ctx.op or "init_process_group")
    return (
        f"{_rank(ctx)} timed out in {_in(ctx)} after {_duration(ms)} waiting for the other ranks: a rank did "
        "not start or died before joining; see the other ranks' and nodes' logs (and check that every node "
        "was launched with the same NNODES and rendezvous endpoint)."
    )


def _peer_died(ctx: _Ctx) -> str:
    return (
        f"{_rank(ctx)} lost its connection to another rank during {_in(ctx)}: that rank died "
        f"({COLLATERAL}); the cause is in the log of the rank that failed first."
    )


def _nccl_timeout(ctx: _Ctx, m: re.Match) -> str:
    rank = m.group("rank") or ctx.rank
    ctx = dataclasses.replace(ctx, rank=rank, op=m.group("op").lower())
    return _timeout(ctx, m.group("ms"))


_Rule = tuple[re.Pattern, Callable[[_Ctx, re.Match], str], bool]
"""(pattern, message builder, collateral): collateral failures are consequences of another rank's."""

_RULES: list[_Rule] = [
    (
        re.compile(r"trainer\.device=cuda but no GPU is visible"),
        lambda c, m: (
            f"{_rank(c)} on {socket.gethostname()}: trainer.device=cuda but no GPU is visible: run on "
            "a GPU node (check CUDA_VISIBLE_DEVICES, sbatch --gpus-per-node) or set trainer.device=cpu "
            "(or auto)."
        ),
        False,
    ),
    (
        re.compile(r"invalid device ordinal"),
        lambda c, m: no_gpu_for_local_rank(c.rank or "?", _env("LOCAL_RANK", "?"), _gpu_count()),
        False,
    ),
    (
        re.compile(
            r"CUDA out of memory\.(?: Tried to allocate (?P<want>[\d.]+ [KMGT]iB)\.)?"
            r"(?:.*?total capacity of (?P<total>[\d.]+ [KMGT]iB) of which (?P<free>[\d.]+ [KMGT]iB) is free)?"
            r"(?:.*?\[megatron-rl phase (?P<phase>\w+)\])?",
            re.DOTALL,
        ),
        _oom,
        False,
    ),
    (
        re.compile(
            r"(?:\[Rank (?P<rank>\d+)\] )?Watchdog caught collective operation timeout: "
            r"WorkNCCL\(SeqNum=\d+, OpType=(?P<op>\w+).*?Timeout\(ms\)=(?P<ms>\d+)\)"
        ),
        _nccl_timeout,
        False,
    ),
    (
        re.compile(r"Timed out waiting (\d+)ms for (?:recv|send) operation"),
        lambda c, m: _timeout(c, m.group(1)),
        False,
    ),
    (
        # The store's wait: in init_process_group (or on its keys in a log) it means a rank never joined.
        re.compile(r"wait timeout after (\d+)ms"),
        lambda c, m: (
            _init_timeout(c, m.group(1))
            if c.op == "init_process_group" or "default_pg" in m.string
            else _timeout(c, m.group(1))
        ),
        False,
    ),
    (
        re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined"),
        lambda c, m: _init_timeout(c, int(m.group(1)) * 1000),
        False,
    ),
    (
        re.compile(
            r"Connection closed by peer|Connection reset by peer|NCCL communicator was aborted|"
            r"remote process exited or there was a network error|Broken pipe"
        ),
        lambda c, m: _peer_died(c),
        True,
    ),
    (
        re.compile(r"EADDRINUSE|[Aa]ddress already in use"),
        lambda c, m: busy_port_message(_port_in(m.string) or _env("MASTER_PORT", "?")),
        False,
    ),
    (
        re.compile(r"RendezvousTimeoutError"),
        lambda c, m: (
            "the rendezvous timed out before every node joined: check that all nodes started "
            "(sbatch --nodes, NNODES) with the same MASTER_ADDR:MASTER_PORT and rendezvous id, and that "
            "node 0 is reachable from them."
        ),
        False,
    ),
    (
        re.compile(r"The connection to the C10d store has failed|RendezvousConnectionError"),
        lambda c, m: (
            "could not reach the rendezvous store on node 0 (MASTER_ADDR:MASTER_PORT = "
            f"{_env('MASTER_ADDR', '?')}:{_env('MASTER_PORT', '?')}): check that node 0 "
            "started, that MASTER_ADDR resolves to node 0 from every node, and that the port is open "
            "between nodes."
        ),
        False,
    ),
    (
        re.compile(r"failed \(exitcode: -9\) local_rank: (\d+)"),
        lambda c, m: (
            f"local rank {m.group(1)} was killed by SIGKILL, usually the host's out-of-memory killer "
            "(check dmesg): lower the batch sizes or the processes per node."
        ),
        False,
    ),
]


def _gpu_count() -> int | str:
    if "torch" not in sys.modules:
        return "fewer"
    import torch

    return torch.cuda.device_count()


def _port_in(text: str) -> str | None:
    m = re.search(r"port: (\d+)", text)
    return m.group(1) if m else None


def explain_text(
    text: str, rank: str | None = None, op: str | None = None, where: str | None = None
) -> str | None:
    """The one-line explanation of an error message (an exception's text or a log line), or None."""
    hit = _match(text, _Ctx(rank, op, where))
    return hit[0] if hit else None


def explain_line(text: str, rank: str | None = None) -> tuple[str, bool] | None:
    """(one-line explanation, collateral) for a line of a log, or None; ``collateral``: the line is a
    consequence of another rank's failure (a lost peer)."""
    return _match(text, _Ctx(rank, None, None))


def _match(text: str, ctx: _Ctx) -> tuple[str, bool] | None:
    for pattern, build, collateral in _RULES:
        m = pattern.search(text)
        if m:
            return build(ctx, m), collateral
    return None


def _context(exc: BaseException) -> _Ctx:
    """Rank from the process group or RANK; the collective and the project frame from the traceback."""
    rank = _speaking_rank()
    op = where = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        if op is None and path.endswith("torch/distributed/distributed_c10d.py") and frame.name != "wrapper":
            op = frame.name  # the outermost c10d function: the public call the caller made
        for root in ("megatron_rl/", "megatron/core/"):
            i = path.rfind("/" + root)
            if i >= 0:  # innermost project frame wins
                where = f"{path[i + 1 :]}:{frame.lineno} in {frame.name}"
    return _Ctx(rank, op, where)


def explain(exc: BaseException) -> str | None:
    """One line saying what happened and what to change, or None for an error this module does not know.

    Looks through the exception's cause chain (innermost first: a RendezvousConnectionError caused by
    EADDRINUSE is a busy port); the rank comes from the process group or RANK, the collective from the
    traceback. A config with several bad keys (``ConfigErrors``) gives one line per key.
    """
    hit = _explain(exc)
    return hit[0] if hit else None


def _explain(exc: BaseException) -> tuple[str, bool] | None:
    """(explanation, collateral) of ``explain``."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):
        if isinstance(e, LaunchError):
            return str(e), False
        if isinstance(e, ConfigError):
            return "\n".join(f"config error: {p}" for p in getattr(e, "problems", None) or [e]), False
        if isinstance(e, DataError):
            return f"data error: {e}", False
    ctx = _context(exc)
    for e in reversed(chain):
        notes = "".join(f"\n{n}" for n in getattr(e, "__notes__", ()))
        hit = _match(f"{type(e).__name__}: {e}{notes}", ctx)
        if hit:
            return hit
    return None


PRINTER_GRACE_S = 10.0
"""How long a rank that leaves a same-on-all-ranks error to local rank 0 waits before it exits (rank 0's
exit ends the job sooner: torchrun then stops the others)."""


def _same_on_all_ranks(exc: BaseException) -> bool:
    return isinstance(exc, ConfigError) or getattr(exc, "same_on_all_ranks", False)


@contextlib.contextmanager
def explain_failures() -> Iterator[None]:
    """Turn an explained exception into one line on stderr and exit status 1; re-raise anything else.

    The full traceback is kept out of the way unless MEGATRON_RL_TRACEBACK=1. Errors that every rank
    hits identically (config, layout) are printed once per node (local rank 0).
    """
    try:
        yield
    except Exception as exc:
        hit = _explain(exc)
        if hit is None:  # its traceback follows; torchrun's summary gets its last line
            _write_torchelastic_error_file(
                f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc()
            )
            raise
        msg, collateral = hit
        if os.environ.get("MEGATRON_RL_TRACEBACK") == "1":
            traceback.print_exc()
        line = "\n".join(PREFIX + part for part in msg.splitlines())
        if not _same_on_all_ranks(exc) or _env("LOCAL_RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)
        else:  # local rank 0 prints it; exiting first would have torchrun stop that rank before it does
            time.sleep(PRINTER_GRACE_S)
        # torchrun's summary names the failure with the earliest error file as the root cause; a rank
        # that only lost its peer writes none, so the rank whose failure caused it is named instead.
        if not collateral:
            _write_torchelastic_error_file(line)
        raise SystemExit(1) from None


def _write_torchelastic_error_file(line: str, callstack: str | None = None) -> None:
    """torchrun's per-worker error file (its documented JSON layout): its failure summary shows ``line``
    (and ``callstack`` where given, else how to get the traceback)."""
    path = _env("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    hint = callstack or f"{line}\n(full traceback: rerun with MEGATRON_RL_TRACEBACK=1)"
    data = {
        "message": {"message": line, "extraInfo": {"py_callstack": hint, "timestamp": str(int(time.time()))}}
    }
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump(data, f)
