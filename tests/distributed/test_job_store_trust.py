"""The job's store under a stranger's writes (CPU, gloo, the transformers engine on a rank of its own):
a forged "stop" written into a running job's store is refused in one line naming its key, and the
training ranks say why they end, instead of the rollout rank leaving silently; without the job's
secret, ranks of their own refuse to start; launch/torchrun.sh gives every rank one secret.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.distributed.test_trainer import metrics, overrides

SEPARATE = {"trainer.placement.rollout": "[2]"}  # actor and critic on [0, 1] (TP=2), the engine on 2


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from megatron_rl.demo import prepare

    return prepare(str(tmp_path_factory.mktemp("demo")))


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "MEGATRON_RL_JOB_SECRET"))}
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def test_a_forged_stop_in_a_running_jobs_store_is_refused_in_one_line(demo, tmp_path):
    """torchrun hosts the store on a known port; after the first step a stranger connects and writes a
    well-formed {"kind": "stop"} under the rollout's next request keys. The rollout rank refuses it
    (naming the key and the port) and the training ranks end naming that cause, within seconds."""
    import torch.distributed as dist

    from megatron_rl.roles.transport import encode
    from megatron_rl.run.ports import free_port

    port, run_dir = free_port(), str(tmp_path / "run")
    args = overrides(
        demo,
        run_dir,
        **{"trainer.total_training_steps": 50, "trainer.test_freq": -1},
        **{"trainer.dist_timeout_minutes": 0.5, **SEPARATE},
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=3"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={port}"]
    cmd += [os.path.join(ROOT, "tests", "distributed", "workers", "train.py"), *args]
    env = _env(MEGATRON_RL_JOB_SECRET="a secret this test does not tell the stranger")
    out_path = tmp_path / "out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not os.path.isfile(os.path.join(run_dir, "logs", "metrics.jsonl")):
                assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text()[-3000:]
                time.sleep(0.2)
            stranger = dist.PrefixStore("rollout/", dist.TCPStore("127.0.0.1", port, is_master=False))
            forged = encode({"kind": "stop"})  # the wire format exactly, without the job's signature
            for i in range(200):  # whichever request the rollout reads next
                stranger.set(f"req/{i}", forged)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = out_path.read_text()
    assert rc != 0, text[-4000:]
    # the rollout rank's own line (torchrun's summary repeats it after "traceback : ")
    pattern = r"^megatron-rl error: (the job's store holds a message under rollout/req/\d+ .*)$"
    refused = re.findall(pattern, text, re.M)
    assert len(refused) == 1, text[-6000:]
    line = refused[0]
    assert "not signed with this job's secret (no signature; a message of the wire format" in line
    assert f"something other than this job wrote to its store (port {port})" in line
    assert line.endswith("(docs/reliability.md, Security and ports).")
    # the training ranks end with its cause, not a timeout or a lost peer
    assert f"megatron-rl error: rollout rank 2 left: {line}" in text, text[-6000:]
    assert "timed out" not in text and "lost its connection" not in text
    assert len(metrics(run_dir)) < 50


def test_ranks_of_their_own_refuse_to_start_without_the_jobs_secret(demo, tmp_path):
    """Plain torchrun without MEGATRON_RL_JOB_SECRET: every rank stops before any process group, in one
    line (once per node: local rank 0 prints it) naming the variable."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    cmd += [os.path.join(ROOT, "tests", "distributed", "workers", "train.py")]
    cmd += overrides(demo, str(tmp_path / "run"), **SEPARATE)
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0, proc.stdout[-3000:]
    lines = re.findall(r"^megatron-rl error: .*$", proc.stderr, re.M)
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "MEGATRON_RL_JOB_SECRET is not set: start the job with launch/torchrun.sh" in lines[0]
    assert "step 1" not in proc.stdout


def test_the_launcher_gives_every_rank_one_secret_and_keeps_a_given_one(tmp_path):
    """launch/torchrun.sh on one node: a random secret, the same on every rank (a digest is compared,
    never the secret); a secret in the environment is kept as it is."""
    script = tmp_path / "show.py"
    script.write_text(
        "import hashlib, os\n"
        "s = os.environ.get('MEGATRON_RL_JOB_SECRET', '')\n"
        "line = f'secret {len(s)} {hashlib.sha256(s.encode()).hexdigest()}\\n'\n"
        "os.write(1, line.encode())  # one write: the two ranks' lines do not interleave\n"
    )

    def digests(**extra: str) -> list[tuple[str, str]]:
        env = _env(PYTHON=sys.executable, ENTRY=str(script), LOG_DIR=str(tmp_path / "logs"), **extra)
        proc = subprocess.run(
            ["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "--nproc", "2", "--config", "x.yaml"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        with open(tmp_path / "logs" / "node0.log") as f:  # the node's log: every rank's output
            log = f.read()
        said = f"rc {proc.returncode}\nlog:\n{log[-3000:]}\nout:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        assert proc.returncode == 0, said
        found = re.findall(r"secret (\d+) ([0-9a-f]{64})", log)
        assert len(found) == 2, said
        return found

    made = digests()
    assert len(made) == 2 and made[0] == made[1] and made[0][0] == "64", made
    again = digests()
    assert again[0] != made[0]  # a new one for each start
    given = "the user's own secret, 40 characters long"
    assert (
        digests(MEGATRON_RL_JOB_SECRET=given)
        == [(str(len(given)), hashlib.sha256(given.encode()).hexdigest())] * 2
    )
