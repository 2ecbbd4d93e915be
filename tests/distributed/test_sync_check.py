"""Sync integrity in the real CPU demo job (TP=2 over two gloo ranks): a weight sync that drops a bucket
before the engine stops the run at that step, in one line naming the tensor, and so does an engine
whose copy ends up permuted (rows reversed, or two elements swapped) at the default
``trainer.sync_check_freq``; a stream that hands the engine wrong-but-consistent weights (a layout
bug: the checksums agree) is caught by the log-prob probe, which passes on a correct run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_rl.demo import prepare
from tests.distributed.test_trainer import metrics, overrides

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")))


WORKER = os.path.join(ROOT, "tests", "distributed", "workers", "stream_fault_train.py")


def _run(demo, out: str, fault: str | None, **kw) -> subprocess.CompletedProcess:
    """The demo job under torchrun; ``fault``: the weight stream's (workers/stream_fault_train.py)."""
    kw = {"trainer.test_freq": -1, "trainer.save_freq": -1, **kw}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [*([WORKER] if fault else ["-m", "megatron_rl.train"]), *overrides(demo, out, **kw)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "STREAM_FAULT": fault or ""}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_a_dropped_bucket_stops_the_run_at_that_step(demo, tmp_path):
    out = str(tmp_path / "run")
    # the second sync (step 2's rollout) drops the demo model's one bucket before the engine sees it
    proc = _run(demo, out, "drop:2:0", **{"trainer.total_training_steps": 3})
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    lines = [ln for ln in text.splitlines() if "weight sync check failed" in ln]
    assert lines, text[-3000:]
    assert "megatron-rl error: step 2: " in lines[0], lines[0]
    assert "does not hold model.embed_tokens.weight (bucket 1 of 1)" in lines[0], lines[0]
    assert "on rank 0 " in lines[0], lines[0]
    assert "/megatron_rl/" not in text, text[-3000:]  # no rank printed a traceback (torchrun's own may)
    assert [r["step"] for r in metrics(out)] == [1]  # step 1 trained; step 2 never did


@pytest.mark.parametrize("kind", ["engine_reverse", "engine_swap"])
def test_a_permuted_engine_copy_stops_the_run_at_the_default_check_frequency(demo, tmp_path, kind):
    """The stream is right; from the engine's second load on (step 1's probe-free rollout is the first,
    the CPU engine reloads every step) its embedding is permuted: sum and sum of squares agree, the
    position-weighted checksum does not."""
    from tests.conftest import zygote

    out = str(tmp_path / "run")
    args = overrides(demo, out, **{"trainer.test_freq": -1, "trainer.save_freq": -1})
    args += ["trainer.total_training_steps=3"]  # sync_check_freq stays at its default (10): no probe
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env["STREAM_FAULT"] = f"{kind}:2:model.embed_tokens.weight"
    codes, stdout, stderr = zygote().launch(WORKER, 2, args, env, 300, ROOT)
    text = stdout + stderr
    assert any(c != 0 for c in codes), text[-3000:]
    lines = [ln for ln in text.splitlines() if "weight sync check failed" in ln]
    assert lines, text[-3000:]
    assert "does not hold model.embed_tokens.weight (bucket 1 of 1)" in lines[0], lines[0]
    assert "on rank 0 " in lines[0], lines[0]
    assert "/megatron_rl/" not in text, text[-3000:]
    assert len(metrics(out)) < 3


def test_the_log_prob_probe_passes_a_correct_run_and_stops_a_wrong_policy(demo, tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    kw = {"trainer.total_training_steps": 2, "trainer.sync_check_freq": 1}
    proc = _run(demo, good, None, **kw)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = metrics(good)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # float32 on both sides: the same policy to rounding
        assert 0 <= r["sync_check/logprob_diff_mean"] < 1e-4 and r["sync_check/logprob_diff_max"] < 1e-3

    # from step 2 on, the stream hands the engine embed_tokens with its rows reversed (the checksums agree
    # with it); on CPU the engine frees its weights after each generation (free_cache_engine), so the
    # probe syncs again: syncs 1 and 2 are step 1's, 3 is step 2's rollout
    proc = _run(demo, bad, "reverse:3:0", **kw)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "weight sync check failed" not in text  # the bytes arrived as sent
    lines = [ln for ln in text.splitlines() if "sync check failed" in ln]
    assert lines and "megatron-rl error: step 2: sync check failed" in lines[0], text[-3000:]
    assert "trainer.sync_check_freq" in lines[0]
    assert [r["step"] for r in metrics(bad)] == [1]
