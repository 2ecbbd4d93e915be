"""The HTTP reward server dies mid-run (SIGKILL, once the run has saved): the job ends within the
configured retries and timeouts in one line naming the server, nothing is left running, the
checkpoints and metrics rows agree, and the newest checkpoint resumes bit for bit (the server scores
as the built-in rule does, so the rows equal a run that never used it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.faults import jobs

SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from megatron_rl.reward.rules import default_compute_score

class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        scores = [
            float(default_compute_score(s["data_source"], s["response"], s["ground_truth"], s["extra_info"]))
            for s in body["samples"]
        ]
        reply = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass

httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(httpd.server_address[1]))
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
httpd.serve_forever()
"""
HTTP_ROW_KEYS = ("reward/http_abandoned/",)  # logged only when the server scores


def _server(tmp_path) -> tuple[subprocess.Popen, str]:
    script, port_file = tmp_path / "server.py", tmp_path / "port"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(script), str(port_file)], env=jobs.env())
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the reward server did not start"
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}/score"


@pytest.mark.slow
def test_the_reward_server_dying_mid_run_ends_the_job_in_one_line(demo, straight, tmp_path):
    server, url = _server(tmp_path)
    run_dir = str(tmp_path / "run")
    kw = {
        "trainer.save_freq": 1,
        "reward_model.http.url": url,
        "reward_model.http.retries": 1,
        "reward_model.http.backoff_s": 0.1,
        "reward_model.http.timeout_s": 5,
    }
    proc = jobs.launch(demo, tmp_path, run_dir, 40, "http", **kw)
    try:
        jobs.wait_for_step(proc, run_dir, 2)
        sids = jobs.sessions(jobs.job(proc.pid)[1])
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        t0 = time.monotonic()
        rc = proc.wait(timeout=300)
        ended_after = time.monotonic() - t0
    finally:
        jobs.kill_launch(proc)
        if server.poll() is None:
            server.kill()
    out = (tmp_path / "http.out").read_text()
    assert rc != 0 and rc != 128 + signal.SIGKILL, out[-4000:]
    heads = ("megatron-rl error: ", "megatron-rl: node 0 failed")
    said = [ln for ln in out.splitlines() if ln.startswith(heads)]
    assert any(url in ln for ln in said), out[-4000:]
    # at most (retries + 1) x timeout_s + backoff per request, plus the step it lands in
    assert ended_after < 120, f"the job took {ended_after:.0f} s to end after the server died"
    assert jobs.left_behind(sids) == []
    last = jobs.assert_consistent(run_dir)
    assert last >= 2
    resumed = jobs.run_torchrun(demo, run_dir, last + 1)  # the built-in rule: what the server computed
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    got = jobs.rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, last + 2))
    for a, b in zip(straight, got, strict=False):
        b = {k: v for k, v in b.items() if not k.startswith(HTTP_ROW_KEYS)}
        assert jobs.stable(a) == jobs.stable(b), f"step {a['step']} differs from the straight run"
