"""Pre-flight checks and one-line explanations (preflight, explain, launch_checks), on real
exceptions and real logs.

The gloo timeout, the lost peer and the init timeout are produced by real process groups
(workers/launch_failures.py); NCCL's watchdog abort cannot happen on CPU, so its explanation is
checked on the log lines an H200 run printed (torch 2.11, a 2-GPU all_reduce whose peer slept).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import pytest

from megatron_rl import errors
from megatron_rl.config import ConfigError, load_config
from megatron_rl.run import explain as ex
from megatron_rl.run import launch_checks as lc
from megatron_rl.run import ports
from megatron_rl.run import preflight as pf
from tests.conftest import ROOT, read_json

DEMO_CFG = os.path.join(ROOT, "yaml", "cpu_demo.yaml")

# Recorded on an H200 pair (torch 2.11.0+cu130): rank 1 slept past an 8 s timeout; the watchdog
# aborted rank 0 (exit -6) without a Python exception. Lines as torchrun's output carried them.
NCCL_WATCHDOG_LOG = """\
[rank0]:[E1130 04:14:59.714924980 ProcessGroupNCCL.cpp:689] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=8000) ran for 8088 milliseconds before timing out.
[rank0]:[E1130 04:14:59.730849103 ProcessGroupNCCL.cpp:2303] [PG ID 0 PG GUID 0(default_pg) Rank 0]  failure detected by watchdog at work sequence id: 2 PG status: last enqueued work: 2, last completed work: 1
[rank0]:[E1130 04:16:06.651926084 ProcessGroupNCCL.cpp:764] [Rank 0] To avoid data inconsistency, we are taking the entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
E1130 04:16:06.561000 799 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: -6) local_rank: 0 (pid: 845) of binary: /opt/torch/.venv/bin/python
"""  # noqa: E501


def _one_line(msg: str | None) -> str:
    assert msg, "no explanation"
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def real_failures(tmp_path_factory):
    """Explanations of real gloo/store failures: one torchrun job (2 ranks) and one plain process."""
    from tests.conftest import run_torchrun

    tmp = tmp_path_factory.mktemp("failures")
    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0"}
    worker = os.path.join(ROOT, "tests", "distributed", "workers", "launch_failures.py")
    init = subprocess.Popen([sys.executable, worker, "--init-timeout", "--out", str(tmp / "i.json")], env=env)
    # When rank 1 leaves, gloo's background thread on rank 0 can abort the process ("terminate called
    # without an active exception") before the all_reduce reports the lost peer: a race inside gloo,
    # about one run in four here. Only that abort is retried, at most twice.
    for attempt in range(3):
        try:
            run_torchrun("launch_failures.py", 2, ["--out", str(tmp / "c.json")], timeout=300, real=True)
            break
        except pytest.fail.Exception as e:
            if attempt == 2 or "terminate called without an active exception" not in str(e):
                raise
    assert init.wait(timeout=120) == 0
    return {**read_json(str(tmp / "c.json")), **read_json(str(tmp / "i.json"))}


def test_gloo_timeout_names_rank_op_duration_and_knob(real_failures):
    r = real_failures["timeout"]
    assert "Timed out waiting 2000ms" in r["raw"], r  # the real gloo error this rule is written for
    msg = _one_line(r["explained"])
    assert msg.startswith("rank 0 timed out in broadcast after 2 s: likely a rank died or is stuck"), msg
    assert "see its log" in msg and "trainer.dist_timeout_minutes" in msg, msg


def test_lost_peer_is_marked_collateral(real_failures):
    r = real_failures["peer"]
    assert "Connection closed by peer" in r["raw"] or "Connection reset by peer" in r["raw"], r
    msg = _one_line(r["explained"])
    assert msg.startswith("rank 0 lost its connection to another rank during all_reduce"), msg
    assert "collateral" in msg


def test_init_timeout_says_a_rank_never_joined(real_failures):
    r = real_failures["init"]
    assert r["type"] == "DistStoreError" and "wait timeout after 1000ms" in r["raw"], r
    msg = _one_line(r["explained"])
    assert msg.startswith("rank 0 timed out in init_process_group after 1 s waiting for the other ranks"), msg


def test_nccl_watchdog_abort_explained_from_the_log():
    msg = _one_line(lc.explain_log(NCCL_WATCHDOG_LOG))
    assert msg.startswith("rank 0 timed out in allreduce after 8 s: likely a rank died or is stuck"), msg
    # The same text as a DistBackendError (what a rank sees when it waits on the aborted work).
    import torch.distributed as dist

    line = NCCL_WATCHDOG_LOG.splitlines()[0]
    assert ex.explain(dist.DistBackendError(line.split("] ", 1)[1])).startswith(
        "rank 0 timed out in allreduce"
    )
    assert ex.explain_text("Timeout(ms)=1800000 ran for 1800100 ms") is None  # needs the watchdog wording
    assert "after 30 min" in ex.explain_text(line.replace("Timeout(ms)=8000", "Timeout(ms)=1800000"))


def test_config_and_layout_errors(monkeypatch, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO_CFG, ["trainer.totl_training_steps=2"])
    assert _one_line(ex.explain(e.value)).startswith(
        "config error: Unknown config key 'trainer.totl_training_steps'"
    )

    cfg = load_config(DEMO_CFG, [])
    with pytest.raises(errors.LaunchError) as e:
        pf.preflight(cfg, 3, env={"LOCAL_WORLD_SIZE": "1", "RANK": "0"})
    msg = _one_line(ex.explain(e.value))
    assert msg.startswith(
        "world size 3 (3 node(s) x 1 process(es) per node) does not fit the parallel layout TP=2"
    ), msg
    assert "multiple of 2" in msg and "tensor_model_parallel_size" in msg
    # A fitting layout passes the launch checks, the model path must exist, then config.validate
    # runs (which rejects the batch).
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path=/nonexistent: no such directory"):
        pf.preflight(load_config(DEMO_CFG, ["actor_rollout_ref.model.path=/nonexistent"]), 2, env={})
    empty = f"actor_rollout_ref.model.path={tmp_path}"  # a directory, but no model in it
    with pytest.raises(ConfigError, match=rf"model\.path={tmp_path}: Cannot tell the checkpoint format"):
        pf.preflight(load_config(DEMO_CFG, [empty]), 2, env={"LOCAL_WORLD_SIZE": "2"})
    from megatron_rl.demo import prepare

    model = f"actor_rollout_ref.model.path={prepare(str(tmp_path / 'demo'))['model']}"
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        pf.preflight(
            load_config(DEMO_CFG, [model, "data.train_batch_size=63"]), 2, env={"LOCAL_WORLD_SIZE": "2"}
        )
    pf.preflight(load_config(DEMO_CFG, [model]), 2, env={"LOCAL_WORLD_SIZE": "2"})


def test_missing_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    from megatron_rl.parallel import resolve_device

    with pytest.raises(RuntimeError) as e:
        resolve_device("cuda")
    msg = _one_line(ex.explain(e.value))
    assert "trainer.device=cuda but no GPU is visible" in msg and "trainer.device=cpu" in msg, msg
    with pytest.raises(errors.LaunchError) as e:
        pf.preflight(load_config(DEMO_CFG, ["trainer.device=cuda"]), 2, env={"RANK": "1"})
    assert _one_line(ex.explain(e.value)).startswith("rank 1 on "), e.value


def test_gpu_oom_names_phase_sizes_and_keys():
    import torch

    from megatron_rl.run.metrics import Timer

    # torch 2.11's message on the H200 (caching allocator), raised inside a timed trainer phase.
    text = (
        "CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 139.81 GiB of "
        "which 1.07 GiB is free. Including non-PyTorch memory, this process has 82.10 GiB memory in use."
    )
    timer = Timer(torch.device("cpu"))
    with pytest.raises(torch.OutOfMemoryError) as e, timer("update_critic"), timer("inner"):
        raise torch.OutOfMemoryError(text)
    msg = _one_line(ex.explain(e.value))
    assert "ran out of GPU memory in phase inner (wanted 2.32 GiB, 1.07 GiB free of 139.81 GiB)" in msg
    assert "ppo_micro_batch_size_per_gpu" in msg and "optimizer_offload" in msg, msg
    assert "in phase" not in _one_line(ex.explain(torch.OutOfMemoryError("CUDA out of memory.")))
    # In a trainer pass the offload keys cannot help (state is parked for generation only): the line
    # names that pass's own micro-batch, token budget and recompute keys instead.
    with pytest.raises(torch.OutOfMemoryError) as e, timer("update_critic"):
        raise torch.OutOfMemoryError(text)
    msg = _one_line(ex.explain(e.value))
    assert "in phase update_critic" in msg and "critic.ppo_max_token_len_per_gpu" in msg, msg
    assert "critic.model.enable_gradient_checkpointing=true" in msg and "optimizer_offload" not in msg, msg
    with pytest.raises(torch.OutOfMemoryError) as e, timer("ref"):
        raise torch.OutOfMemoryError(text)
    msg = _one_line(ex.explain(e.value))
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu" in msg and "checkpointing" not in msg


def test_port_checks():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        msg = _one_line(ports.check_port("127.0.0.1", port))
        assert msg.startswith(f"rendezvous port {port} is already in use on node 0"), msg
        assert "MASTER_PORT=" in msg
        # The same port reported by torch's own bind failure (static rendezvous / is_host=1).
        torch_line = (
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
            f"address. port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already "
            "in use"
        )
        assert _one_line(lc.explain_log(torch_line)).startswith(f"rendezvous port {port} is already in use")
    assert ports.check_port("127.0.0.1", ports.free_port()) is None
    # TEST-NET-3 (RFC 5737) is nobody's address: node 0 must not claim it (bind fails locally, no traffic).
    not_ours = ports.check_port("203.0.113.7", ports.free_port())
    assert "is not an address of this machine" in _one_line(not_ours)


def test_explain_failures_prints_one_line_and_exits_1(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", os.devnull)
    with pytest.raises(SystemExit) as e, ex.explain_failures():
        load_config(DEMO_CFG, ["trainer.bogus=1"])
    assert e.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        ex.PREFIX + "config error: Unknown config key 'trainer.bogus'"
    ), err
    # Identical on every rank: printed by local rank 0 only.
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit), ex.explain_failures():
        load_config(DEMO_CFG, ["trainer.bogus=1"])
    assert capsys.readouterr().err == ""
    # Unknown errors keep their traceback.
    with pytest.raises(KeyError), ex.explain_failures():
        raise KeyError("not a launch problem")


def test_torchelastic_error_file_carries_the_line(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(SystemExit), ex.explain_failures():
        raise errors.LaunchError("rank 3: something actionable.")
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    # torchrun's own reader of the file: its failure summary shows our line.
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == ex.PREFIX + "rank 3: something actionable."


def test_root_cause_box_names_the_cause_not_a_collateral_rank(tmp_path, monkeypatch):
    """A rank that only lost its peer writes no error file, and a rank that fails with a traceback writes
    one: torchrun's summary (its own reader, on the files the ranks left) names the rank whose failure
    caused the other's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    files = {r: tmp_path / f"error{r}.json" for r in (0, 1)}
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[1]))
    with pytest.raises(SystemExit), ex.explain_failures():  # rank 1: its peer died
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert not files[1].exists()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[0]))
    with pytest.raises(KeyError), ex.explain_failures():  # rank 0: the cause, not one explain knows
        raise KeyError("values")
    # the agent notices the collateral exit after the cause's file was written (same second: rank order)
    failures = {
        0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(files[0])),
        1: ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=str(files[1])),
    }
    rank, failure = ChildFailedError("megatron_rl.train", failures).get_first_failure()
    assert rank == 0 and failure.message["message"] == "KeyError: 'values'"
    assert "Traceback" in failure.message["extraInfo"]["py_callstack"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_missing_logger_stops_every_rank_before_any_model_in_one_line(tmp_path):
    """torchrun, 2 ranks, trainer.logger=wandb without wandb: one line (local rank 0 prints it), no
    traceback, and torchrun's root-cause box shows the same line."""
    from megatron_rl.demo import prepare

    d = prepare(str(tmp_path / "demo"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "megatron_rl.train", "--config", DEMO_CFG, f"actor_rollout_ref.model.path={d['model']}"]
    cmd += [f"data.train_files={d['train']}", f"data.val_files={d['test']}", "trainer.logger=[console,wandb]"]
    cmd += [f"trainer.default_local_dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith(ex.PREFIX)]
    assert len(ours) == 1 and ours[0].startswith(ex.PREFIX + "config error: trainer.logger="), p.stderr
    assert "pip install wandb" in ours[0]
    # no rank's traceback (torchrun's own agent still prints its ChildFailedError)
    assert not [
        line for line in p.stderr.splitlines() if line.strip().startswith("File") and "megatron_rl" in line
    ]
    box = p.stderr.split("Root Cause (first observed failure):")[1]
    assert ours[0] in box
    assert not (tmp_path / "run").exists()


def test_several_config_problems_are_one_line_each(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", os.devnull)
    with pytest.raises(SystemExit), ex.explain_failures():
        load_config(DEMO_CFG, ["trainer.bogus=1", "data.nope=2"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(
        line.startswith(ex.PREFIX + "config error: Unknown config key") for line in err
    )


def test_explain_log_prefers_the_first_cause():
    cause = "Traceback (most recent call last):\nKeyError: 'values'\n"
    collateral = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6892\n"
    timeout = (
        "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 1800000ms for recv operation to complete\n"
    )
    # An unexplained crash before a timeout is the cause; a lost peer alone is reported as collateral.
    assert (
        lc.explain_log(cause + timeout)
        == "a rank failed with KeyError: 'values' (its traceback is in the log)."
    )
    assert "collateral" in lc.explain_log(collateral)
    assert lc.explain_log(collateral + timeout).startswith("a rank timed out in a collective after 30 min")
    assert lc.explain_log(collateral + ex.PREFIX + "config error: bad key\n") == "config error: bad key"
    agent = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    assert lc.explain_log(agent) is None


def test_nnodes_and_gpus_per_node_must_match_the_launch(tmp_path):
    from megatron_rl.demo import prepare

    model = f"actor_rollout_ref.model.path={prepare(str(tmp_path / 'demo'))['model']}"
    env = {"LOCAL_WORLD_SIZE": "2"}
    pf.preflight(load_config(DEMO_CFG, [model, "trainer.nnodes=1", "trainer.n_gpus_per_node=2"]), 2, env=env)
    with pytest.raises(errors.LaunchError, match=r"n_gpus_per_node=8 but this job was launched with 2"):
        pf.preflight(load_config(DEMO_CFG, [model, "trainer.n_gpus_per_node=8"]), 2, env=env)
    with pytest.raises(errors.LaunchError, match=r"trainer\.nnodes=2 but this job was launched with 1"):
        pf.preflight(load_config(DEMO_CFG, [model, "trainer.nnodes=2"]), 2, env=env)
