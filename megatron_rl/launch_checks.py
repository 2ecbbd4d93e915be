"""Pre-flight checks of a launch, and one-line explanations of the ways a distributed launch fails.

A failed multi-process job prints hundreds of lines (one traceback per rank, torchrun's summary, NCCL
dumps) while the cause fits in one. This module turns the known failures into ONE line saying what
happened and what to change. It is used in three places:

* ``launch/torchrun.sh`` on the node hosting the rendezvous, before torchrun starts::

      python -m megatron_rl.launch_checks port HOST PORT     # exit 1 + one line if HOST:PORT is unusable

* the trainer on every rank (``megatron_rl.train.main``)::

      with explain_failures():
          cfg = load_config(path, overrides)
          preflight(cfg, world_size)        # launch layout and device, then config.validate
          ...                               # init_parallel, Trainer(cfg, ps).fit()

  An exception that :func:`explain` recognises becomes ``megatron-rl error: <line>`` on stderr (and in
  torchrun's error file, so torchrun's failure summary shows the same line) and the rank exits with
  status 1; anything else propagates unchanged with its traceback.

* ``launch/torchrun.sh`` after torchrun exited non-zero::

      python -m megatron_rl.launch_checks explain-log NODE_LOG --node N --rc RC

  reads the node's log and prints one line, also for failures no Python handler sees: NCCL's watchdog
  aborts the process on a timeout (SIGABRT, no exception), and the rendezvous errors are raised in
  torchrun's agent, not in a worker.

One rule table (:data:`_RULES`, regex -> message) serves exceptions and log lines alike. Nothing here
imports torch at module level: the port check runs before any heavy import.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

PREFIX = "megatron-rl error: "
"""Start of the one line a rank prints for an explained failure (``explain-log`` looks for it)."""


class LaunchError(RuntimeError):
    """A launch that cannot work (layout vs world size, device, port); the message is one actionable line.

    ``same_on_all_ranks``: every rank raises the same error, so only local rank 0 of each node prints it.
    """

    def __init__(self, message: str, same_on_all_ranks: bool = False) -> None:
        super().__init__(message)
        self.same_on_all_ranks = same_on_all_ranks


# --------------------------------------------------------------------------------------------------
# Pre-flight
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port that nothing listens on right now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot host the rendezvous store on this machine, or None if it can.

    Binds the way torch's TCPStore server does (all interfaces, SO_REUSEADDR, so a port in TIME_WAIT
    is not reported) and checks that ``host`` names this machine.
    """
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)}
    except socket.gaierror as e:
        return (
            f"rendezvous host {host!r} (MASTER_ADDR) does not resolve on this node ({e.strerror}): "
            "use a hostname or IP of node 0."
        )
    for addr in sorted(addrs):
        if addr.startswith("127."):
            continue
        with socket.socket() as s:
            try:
                s.bind((addr, 0))
            except OSError:
                return (
                    f"rendezvous host {host} (MASTER_ADDR) resolves to {addr}, which is not an address of "
                    f"this machine ({socket.gethostname()}), but this node (node rank 0) hosts the "
                    "rendezvous: set MASTER_ADDR to node 0's hostname or IP."
                )
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return _busy_port_message(port)
            return (
                f"cannot listen on rendezvous port {port} ({e.strerror}): choose another port with "
                f"MASTER_PORT (e.g. MASTER_PORT={free_port()})."
            )
    return None


def _busy_port_message(port: int | str) -> str:
    return (
        f"rendezvous port {port} is already in use on node 0 (another job or a leftover process holds it): "
        f"set MASTER_PORT to a free port (e.g. MASTER_PORT={free_port()}) or stop the process holding it "
        f"(ss -ltnp 'sport = :{port}')."
    )


def preflight(cfg: Any, world_size: int, env: Mapping[str, str] | None = None) -> None:
    """Check that this launch can run ``cfg`` before any process group starts, then ``config.validate``.

    Raises :class:`LaunchError` (launch layout, device) or ``ConfigError`` (from validate), each a
    one-line message. ``env`` defaults to ``os.environ`` (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE).
    """
    from megatron_rl.config import validate

    env = os.environ if env is None else env
    mp = cfg.actor_rollout_ref.actor.megatron
    tp, pp = mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size
    per_node = int(env.get("LOCAL_WORLD_SIZE", world_size))
    nodes = max(1, world_size // max(per_node, 1))
    if tp >= 1 and pp >= 1 and world_size % (tp * pp):
        raise LaunchError(
            f"world size {world_size} ({nodes} node(s) x {per_node} process(es) per node) does not fit the "
            f"parallel layout TP={tp} x PP={pp}: launch a multiple of {tp * pp} processes "
            "(launch/torchrun.sh --nproc, torchrun --nproc_per_node, sbatch --nodes) or set "
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size x pipeline_model_parallel_size "
            f"to a divisor of {world_size}.",
            same_on_all_ranks=True,
        )
    _check_device(cfg.trainer.device, env)
    _check_model_paths(cfg)
    validate(cfg, world_size=world_size)


def _check_model_paths(cfg: Any) -> None:
    """Model and tokenizer paths are local directories (nothing is downloaded): one line if not."""
    from megatron_rl.config import ConfigError

    for key, path in (
        ("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path),
        ("critic.model.path", cfg.critic.model.path if cfg.critic.enable else None),
        ("data.tokenizer", cfg.data.tokenizer),
    ):
        if path and not os.path.isdir(path):
            raise ConfigError(
                f"{key}={path}: no such directory. Point it at a local HF model directory or Megatron "
                "checkpoint (models are not downloaded from a hub)."
            )
        if path and key != "data.tokenizer":
            from megatron_rl.models.loading import detect_format

            try:
                detect_format(path)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"{key}={path}: {e}") from None


def _check_device(device: str, env: Mapping[str, str]) -> None:
    import torch

    from megatron_rl.parallel import resolve_device

    rank = env.get("RANK", "0")
    try:
        dev = resolve_device(device)
    except RuntimeError as e:
        raise LaunchError(explain_text(str(e), rank=rank) or f"rank {rank}: {e}") from None
    if dev.type == "cuda":
        local_rank, count = int(env.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local_rank >= count:
            raise LaunchError(_no_gpu_for_local_rank(rank, local_rank, count))


def _no_gpu_for_local_rank(rank: Any, local_rank: Any, count: Any) -> str:
    return (
        f"rank {rank} (local rank {local_rank}) on {socket.gethostname()} has no GPU: the node shows {count} "
        "GPU(s) but more processes were started per node: start at most one process per GPU "
        "(launch/torchrun.sh --nproc / NPROC_PER_NODE, torchrun --nproc_per_node) or check "
        "CUDA_VISIBLE_DEVICES."
    )


# --------------------------------------------------------------------------------------------------
# Explanations
# --------------------------------------------------------------------------------------------------


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


def _timeout(ctx: _Ctx, ms: str) -> str:
    return (
        f"{_rank(ctx)} timed out in {_in(ctx)} after {_duration(ms)}: likely a rank died or is stuck; "
        "see its log (the first rank that failed holds the cause); if the step is legitimately that slow, "
        f"raise {TIMEOUT_KEY}."
    )


def _oom(ctx: _Ctx, m: re.Match) -> str:
    sizes = ""
    if m["want"]:
        sizes = f" (wanted {m['want']}" + (f", {m['free']} free of {m['total']}" if m["free"] else "") + ")"
    phase = f" in phase {m['phase']}" if m["phase"] else ""
    return (
        f"{_rank(ctx)} ran out of GPU memory{phase}{sizes}: lower "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu / *.log_prob_micro_batch_size_per_gpu or "
        "actor_rollout_ref.rollout.gpu_memory_utilization; keep rollout.free_cache_engine=True and turn on "
        "*.megatron.param_offload / grad_offload / optimizer_offload; or raise "
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size."
    )


def _init_timeout(ctx: _Ctx, ms: str) -> str:
    ctx = dataclasses.replace(ctx, op=ctx.op or "init_process_group")
    return (
        f"{_rank(ctx)} timed out in {_in(ctx)} after {_duration(ms)} waiting for the other ranks: a rank did "
        "not start or died before joining; see the other ranks' and nodes' logs (and check that every node "
        "was launched with the same NNODES and rendezvous endpoint)."
    )


_COLLATERAL = "this rank is collateral"


def _peer_died(ctx: _Ctx) -> str:
    return (
        f"{_rank(ctx)} lost its connection to another rank during {_in(ctx)}: that rank died "
        f"({_COLLATERAL}); the cause is in the log of the rank that failed first."
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
        lambda c, m: _no_gpu_for_local_rank(c.rank or "?", os.environ.get("LOCAL_RANK", "?"), _gpu_count()),
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
        lambda c, m: _busy_port_message(_port_in(m.string) or os.environ.get("MASTER_PORT", "?")),
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
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}): check that node 0 "
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


def _match(text: str, ctx: _Ctx) -> tuple[str, bool] | None:
    for pattern, build, collateral in _RULES:
        m = pattern.search(text)
        if m:
            return build(ctx, m), collateral
    return None


def _context(exc: BaseException) -> _Ctx:
    """Rank from the process group or RANK; the collective and the project frame from the traceback."""
    rank = os.environ.get("RANK")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank = str(dist.get_rank())
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
    traceback.
    """
    from megatron_rl.config import ConfigError, DataError

    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):
        if isinstance(e, LaunchError):
            return str(e)
        if isinstance(e, ConfigError):
            return f"config error: {e}"
        if isinstance(e, DataError):
            return f"data error: {e}"
    ctx = _context(exc)
    for e in reversed(chain):
        notes = "".join(f"\n{n}" for n in getattr(e, "__notes__", ()))
        hit = _match(f"{type(e).__name__}: {e}{notes}", ctx)
        if hit:
            return hit[0]
    return None


def _same_on_all_ranks(exc: BaseException) -> bool:
    from megatron_rl.config import ConfigError

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
        msg = explain(exc)
        if msg is None:
            raise
        if os.environ.get("MEGATRON_RL_TRACEBACK") == "1":
            traceback.print_exc()
        line = PREFIX + msg
        if not _same_on_all_ranks(exc) or os.environ.get("LOCAL_RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)
        _write_torchelastic_error_file(line)
        raise SystemExit(1) from None


def _write_torchelastic_error_file(line: str) -> None:
    """torchrun's per-worker error file (its documented JSON layout): its failure summary shows ``line``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    hint = f"{line}\n(full traceback: rerun with MEGATRON_RL_TRACEBACK=1)"
    data = {
        "message": {"message": line, "extraInfo": {"py_callstack": hint, "timestamp": str(int(time.time()))}}
    }
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump(data, f)


_EXC_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(?P<type>(?:\w+\.)*\w+(?:Error|Exception)): (?P<msg>.+)$")
_RANK_TAG = re.compile(r"\[[Rr]ank ?(\d+)\]")
_AGENT_NOISE = ("ChildFailedError", "SignalException")


def explain_log(text: str) -> str | None:
    """One line for a failed node from its log (torchrun's and every local rank's output), or None.

    Reads the log in order, because the first failure is usually the cause and later ones its
    consequences: the first explained line (a rank's own :data:`PREFIX` line, a config error, or a line a
    rule explains) wins, unless an unexplained exception came before it, which is then reported.
    Lost-peer lines only count when nothing else is found.
    """
    first_exception = first_collateral = None
    for line in text.splitlines():
        i = line.find(PREFIX)
        if i >= 0:
            msg = line[i + len(PREFIX) :].strip()
            hit: tuple[str, bool] | None = (msg, _COLLATERAL in msg)
        elif line.startswith("config error: "):
            hit = (line.strip(), False)
        else:
            tag = _RANK_TAG.search(line)
            hit = _match(line, _Ctx(tag.group(1) if tag else None, None, None))
        if hit and not hit[1]:
            return first_exception or hit[0]
        if hit:
            first_collateral = first_collateral or hit[0]
            continue
        m = _EXC_LINE.match(line.strip())
        if m and first_exception is None and not m.group("type").endswith(_AGENT_NOISE):
            first_exception = (
                f"a rank failed with {m.group('type').rsplit('.', 1)[-1]}: {m.group('msg').strip()} "
                "(its traceback is in the log)."
            )
    return first_exception or first_collateral


# --------------------------------------------------------------------------------------------------
# Command line (used by launch/torchrun.sh)
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_rl.launch_checks", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("port", help="exit 1 with one line if HOST:PORT cannot host the rendezvous here")
    p.add_argument("host")
    p.add_argument("port", type=int)
    sub.add_parser("free-port", help="print a free TCP port")
    p = sub.add_parser("explain-log", help="one line saying why a node's torchrun failed")
    p.add_argument("log")
    p.add_argument("--node", default="0")
    p.add_argument("--rc", default="?")
    a = ap.parse_args(argv)

    if a.cmd == "port":
        msg = check_port(a.host, a.port)
        if msg:
            print(PREFIX + msg, file=sys.stderr)
            return 1
        return 0
    if a.cmd == "free-port":
        print(free_port())
        return 0
    try:
        with open(a.log, errors="replace") as f:
            text = f.read()
    except OSError as e:
        text = ""
        print(f"megatron-rl: cannot read {a.log}: {e.strerror}", file=sys.stderr)
    why = explain_log(text) or "no known cause found; the first traceback in the log is the place to start."
    print(f"megatron-rl: node {a.node} failed (exit {a.rc}): {why} Log: {a.log}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
