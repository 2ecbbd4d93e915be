"""Real distributed failures, each passed through explain.explain (test_launch_checks.py).

Under torchrun with 2 ranks (gloo):
  1. a 2 s group where rank 1 never joins rank 0's broadcast  -> gloo's recv timeout on rank 0;
  2. rank 1 leaves the job, rank 0 all_reduces               -> "Connection closed by peer" on rank 0.
As a plain process (``--init-timeout``): init_process_group as rank 0 of a world of 2 whose rank 1
never comes -> the store's wait timeout inside init_process_group.

Rank 0 writes {scenario: {"type", "raw", "explained"}} to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.run.explain import explain
from megatron_rl.run.ports import free_port


def record(e: BaseException) -> dict:
    return {"type": type(e).__name__, "raw": str(e), "explained": explain(e)}


def init_timeout() -> dict:
    store = dist.TCPStore("127.0.0.1", free_port(), world_size=2, is_master=True, wait_for_workers=False)
    try:
        dist.init_process_group(
            "gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=1)
        )
    except Exception as e:
        return {"init": record(e)}
    raise AssertionError("init_process_group returned without its second rank")


def collectives() -> dict:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    out = {}
    if rank == 0:
        try:
            dist.broadcast(torch.ones(4), src=1, group=short)  # rank 1 never sends
            raise AssertionError("broadcast completed without its source")
        except RuntimeError as e:
            out["timeout"] = record(e)
    dist.barrier()
    if rank == 1:
        os._exit(0)  # leaves without a word; exit 0 so torchrun lets rank 0 run on
    try:
        dist.all_reduce(torch.ones(4))
        raise AssertionError("all_reduce completed without its peer")
    except RuntimeError as e:
        out["peer"] = record(e)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--init-timeout", action="store_true")
    a = ap.parse_args()
    out = init_timeout() if a.init_timeout else collectives()
    if int(os.environ.get("RANK", 0)) == 0:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
