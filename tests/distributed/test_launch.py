"""launch/torchrun.sh end to end: two rendezvous "nodes" on one machine train at TP=2 across them, and the
launch failures (busy port, layout vs world size, missing GPU) end in one line and a non-zero status.

Every run here is the real trainer (``-m megatron_rl.train``) under the real torchrun; the two-node run
uses torch's c10d rendezvous on 127.0.0.1 exactly as two hosts would use node 0's address.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from megatron_rl.run import explain as ex
from megatron_rl.run import launch_checks as lc
from megatron_rl.run import ports
from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "launch", "torchrun.sh")
DEMO_CFG = os.path.join(ROOT, "yaml", "cpu_demo.yaml")


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")
    }
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


def _launch(args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", SCRIPT, *args], env=_env(**env), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def _last_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines, f"no stderr; stdout:\n{p.stdout[-3000:]}"
    return lines[-1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, str]:
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("demo")))


def test_busy_port_fails_in_one_line_before_torchrun(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = _launch(
            ["--nproc", "1", "--master-port", str(port), "--log-dir", str(tmp_path), "--config", DEMO_CFG]
        )
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"{ex.PREFIX}rendezvous port {port} is already in use on node 0"), lines[0]
    assert "torch.distributed.run" not in (tmp_path / "node0.log").read_text()  # torchrun never started


def test_busy_port_reported_by_torchrun_itself_is_explained(tmp_path):
    """Past the pre-check (the port taken in between): torchrun's own bind error becomes the same line."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=1"]
        cmd += ["--max-restarts", "0", "-m", "megatron_rl.train", "--config", DEMO_CFG]
        p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0
    assert "EADDRINUSE" in p.stderr  # the agent failed to host the store, at once
    msg = lc.explain_log(p.stdout + p.stderr)
    assert msg and msg.startswith(f"rendezvous port {port} is already in use"), msg


@pytest.mark.parametrize(
    "nproc,overrides,expect",
    [
        ("1", [], ("orld size 1", "tensor_model_parallel_size")),
        ("2", ["trainer.device=cuda"], ("trainer.device=cuda but no GPU is visible", "trainer.device=cpu")),
    ],
    ids=["world-size-vs-tp2", "device-cuda-without-gpu"],
)
def test_trainer_failure_ends_in_one_line(tmp_path, nproc, overrides, expect):
    import torch

    if "trainer.device=cuda" in overrides and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    p = _launch(["--nproc", nproc, "--log-dir", str(tmp_path), "--config", DEMO_CFG, *overrides])
    assert p.returncode != 0
    last = _last_line(p)
    assert last.startswith(f"megatron-rl: node 0 failed (exit {p.returncode}): "), last
    for part in expect:
        assert part in last, last
    assert last in (tmp_path / "node0.log").read_text()  # the node log ends with the same line


def test_bad_inputs_end_in_one_line_before_any_model_is_built(tmp_path, demo, capsys):
    """A wrong model path, a missing data file, a file that is not parquet, a row without a ground
    truth: one line naming the key, file, row or column, from the launcher, before training starts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file")
    no_truth = tmp_path / "no_truth.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "prompt": [{"role": "user", "content": "copy 1 2 ="}],
                    "data_source": "toy/copy_last_digit",
                    "reward_model": {"style": "rule"},
                }
            ]
        ),
        no_truth,
    )
    base = [f"actor_rollout_ref.model.path={demo['model']}", f"data.val_files=[{demo['test']}]"]
    cases = [
        (
            [f"data.train_files=[{demo['train']}]", *base[1:], "actor_rollout_ref.model.path=/nonexistent/x"],
            "actor_rollout_ref.model.path=/nonexistent/x: no such",
        ),
        (
            [*base, "data.train_files=/nonexistent/train.parquet"],
            "data file '/nonexistent/train.parquet' does not exist",
        ),
        ([*base, f"data.train_files={garbage}"], f"data file '{garbage}' is not a readable parquet file"),
        (
            [*base, f"data.train_files={no_truth}"],
            f"{no_truth}: row 0 has reward_model={{'style': 'rule'}} without a 'ground_truth'",
        ),
    ]
    from megatron_rl.run.preflight import main as dry_run

    for k, (overrides, expect) in enumerate(cases):
        # every case through the dry run (the same checks, in process); a config error and a data
        # error through a real launch too (the launcher's one line, no traceback)
        assert dry_run(["--check", DEMO_CFG, *overrides]) == 1
        said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("megatron-rl error: ")]
        assert len(said) == 1 and expect in said[0], said
        if k in (0, 3):
            p = _launch(["--nproc", "2", "--log-dir", str(tmp_path), "--config", DEMO_CFG, *overrides])
            last = _last_line(p)
            assert p.returncode != 0 and expect in last, last
            assert "Traceback" not in p.stderr, p.stderr[-3000:]


def test_a_launcher_that_cannot_trap_sigint_says_so(tmp_path):
    """Started in the background of a script, bash inherits SIGINT ignored and cannot trap it: the
    launcher says to stop the job with SIGTERM instead (and says nothing when SIGINT is at its default)."""
    args = ["bash", SCRIPT, "--nproc", "1", "--log-dir", str(tmp_path), "--config", DEMO_CFG]
    args.append("actor_rollout_ref.model.path=/nonexistent/model")
    said = {}
    for name, disposition in (("ignored", signal.SIG_IGN), ("default", signal.SIG_DFL)):
        p = subprocess.run(
            args, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
            preexec_fn=lambda d=disposition: signal.signal(signal.SIGINT, d),
        )  # fmt: skip
        said[name] = p.stderr
    assert "SIGINT is ignored in this shell (started in the background or under nohup)" in said["ignored"]
    assert "use SIGTERM" in said["ignored"]
    assert "SIGINT is ignored" not in said["default"], said["default"]


def test_two_nodes_rendezvous_and_train_tp2_across_them(tmp_path, demo):
    """Two torchrun agents (--nnodes 2, one process each, c10d on 127.0.0.1) run 2 PPO steps at TP=2."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    overrides = [
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_at_end=true",
        f"trainer.default_local_dir={run_dir}",
        f"data.train_files=[{demo['train']}]",
        f"data.val_files=[{demo['test']}]",
        f"actor_rollout_ref.model.path={demo['model']}",
    ]
    env = _env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports.free_port()), LOG_DIR=str(logs))
    env["RDZV_ID"] = f"two-nodes-{env['MASTER_PORT']}"
    nodes = [
        subprocess.Popen(
            ["bash", SCRIPT, "--nproc", "1", "--node-rank", str(r), "--config", DEMO_CFG, *overrides],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [n.communicate(timeout=600)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    for r, (n, out) in enumerate(zip(nodes, outs, strict=True)):
        assert n.returncode == 0, f"node {r} exit {n.returncode}:\n{out[-6000:]}"
        assert f"megatron-rl: node {r} of 2" in (logs / f"node{r}.log").read_text()

    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "actor/pg_loss" in r) == [1, 2]
    # One model replica sharded over both nodes: TP=2, world 2, a state file per TP shard.
    state = json.loads((run_dir / "global_step_2" / "trainer_state.json").read_text())
    assert state["layout"] == {"tp": 2, "pp": 1, "dp": 1, "world_size": 2}, state["layout"]
    assert sorted(p.name for p in (run_dir / "global_step_2").glob("mp_rank_*.pt")) == [
        "mp_rank_00_000.pt",
        "mp_rank_01_000.pt",
    ]
