"""The launcher's side of a launch: the rendezvous port check, and one line for a failed node.

``launch/torchrun.sh`` runs, on the node hosting the rendezvous, before torchrun starts::

    python -m megatron_rl.run.launch_checks port HOST PORT     # exit 1 + one line if HOST:PORT is unusable

and after torchrun exited non-zero::

    python -m megatron_rl.run.launch_checks explain-log NODE_LOG --node N --rc RC

which reads the node's log and prints one line, also for failures no Python handler sees: NCCL's
watchdog aborts the process on a timeout (SIGABRT, no exception), and the rendezvous errors are raised
in torchrun's agent, not in a worker. The lines come from the rule table of :mod:`megatron_rl.run.explain`
(which explains a rank's own exception); the pre-flight checks of every rank are
:mod:`megatron_rl.run.preflight`. Nothing here imports torch: the port check runs before any heavy import.
"""

from __future__ import annotations

import argparse
import re
import sys

from megatron_rl.errors import COLLATERAL
from megatron_rl.run.explain import PREFIX, explain_line
from megatron_rl.run.ports import check_port, free_port

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
            hit: tuple[str, bool] | None = (msg, COLLATERAL in msg)
        elif line.startswith("config error: "):
            hit = (line.strip(), False)
        else:
            tag = _RANK_TAG.search(line)
            hit = explain_line(line, tag.group(1) if tag else None)
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
        prog="python -m megatron_rl.run.launch_checks", description=__doc__.split("\n\n")[0]
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
