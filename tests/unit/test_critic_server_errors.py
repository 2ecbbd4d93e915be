"""A critic rank's failed save or load, seen from the actor's ranks (two real gloo ranks, the job's
store a real FileStore): a checkpoint problem is a CheckpointError chained from the critic rank's
traceback; a bug is not called a checkpoint failure; every critic rank logs its traceback with its rank."""

from __future__ import annotations

import json
import logging
import os

import torch

from megatron_rl.job_secret import JobSecret
from tests.conftest import run_forked_ranks

SECRET = JobSecret(b"the two ranks' shared secret")


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_rl.config import load_config
    from megatron_rl.errors import CheckpointError
    from megatron_rl.parallel import ParallelState
    from megatron_rl.roles.critic import RemoteCritic
    from megatron_rl.roles.critic_server import CriticServer, CriticServerError
    from megatron_rl.run.metrics import Timer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    logging.getLogger("megatron_rl.roles.critic_server").addHandler(
        logging.FileHandler(os.path.join(out_dir, f"log{rank}"))
    )
    cpu, world = torch.device("cpu"), dist.group.WORLD
    ps = ParallelState(
        rank=rank, world_size=2, local_rank=rank, device=cpu, backend="gloo",
        tp_size=1, pp_size=1, dp_size=2, tp_rank=0, pp_rank=0, dp_rank=rank,
        tp_group=None, pp_group=None, dp_group=world, mp_group=None, embedding_group=None,
        job_store=dist.FileStore(os.path.join(out_dir, "job"), 2), job_secret=SECRET,
    )  # fmt: skip
    # the same two ranks play the critic's server and the actor's client, one request at a time
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/x"])  # as train.py hands it over
    server, client = CriticServer(cfg, ps), RemoteCritic(ps, 3, 0, Timer(cpu))  # client posts req/0
    requests = [
        {"kind": "load", "path": os.path.join(out_dir, "no_such_step"), "counters": {}},  # missing files
        {"kind": "save", "dir": os.path.join(out_dir, "step")},  # no init request before: a bug
    ]
    seen = []
    for i, msg in enumerate(requests, start=1):
        getattr(server, f"_{msg['kind']}")(i, msg)  # what CriticServer.serve does with req/<i>
        try:
            client._ask(msg)
            seen.append(None)
        except Exception as e:
            cause = e.__cause__
            seen.append(
                {
                    "type": type(e).__name__,
                    "checkpoint": isinstance(e, CheckpointError),
                    "message": str(e),
                    "cause": type(cause).__name__ if cause else None,
                    "remote": (cause if isinstance(e, CheckpointError) else e).remote_traceback
                    if isinstance(cause or e, CriticServerError)
                    else None,
                }
            )
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def test_checkpoint_failures_and_bugs_keep_their_traceback(tmp_path):
    run_forked_ranks(_worker, tmp_path)
    for r in (0, 1):
        load, save = json.loads((tmp_path / f"rank{r}").read_text())
        # a missing critic/ is a checkpoint problem: one line, chained from the critic rank's traceback
        assert load["checkpoint"] and load["cause"] == "CriticServerError", load
        assert "failed on critic rank 0: FileNotFoundError" in load["message"]
        assert "Traceback" in load["remote"] and "critic_server.py" in load["remote"]
        # a bug on the critic ranks is not a CheckpointError, and its message carries the traceback
        assert save["type"] == "CriticServerError" and not save["checkpoint"], save
        assert "RuntimeError" in save["message"] and "Traceback" in save["message"]
        assert "before its init request" in save["message"]
        assert "critic_server.py" in save["remote"] and "in work" in save["remote"]
        log = (tmp_path / f"log{r}").read_text()
        assert f"critic rank {r}: load (request 1) failed" in log and "FileNotFoundError" in log
        assert f"critic rank {r}: save (request 2) failed" in log and "Traceback" in log


def test_the_servers_message_types_are_the_clients():
    from megatron_rl.roles import critic, critic_data, critic_server

    assert critic_server.MESSAGE_TYPES is critic.MESSAGE_TYPES is critic_data.MESSAGE_TYPES  # one home
