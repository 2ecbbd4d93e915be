"""Quiet, truthful logs: an SGLang start logs one line of its arguments (its own dump of them goes to
DEBUG), a run that started SGLang ends without a resource-tracker traceback, and megatron-core's
fallback notices become one line of ours. SGLang is not needed: a fake ``sglang`` module does to the
process what ``sglang.Engine`` does."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

from megatron_rl.config.rollout_sections import RolloutConfig
from megatron_rl.rollout.sglang_start import (
    ServerArgsToDebug,
    engine_arguments,
    engine_summary,
    server_args_at_debug,
    start_sglang,
)

ROOT = Path(__file__).resolve().parents[2]
SGLANG_LOGGER = "sglang.srt.entrypoints.engine"
OURS = "megatron_rl.rollout.sglang_start"
SERVER_ARGS = (
    "server_args=ServerArgs(model_path='/tmp/megatron_rl_sglang_x', tp_size=1, " + "x=1, " * 3000 + ")"
)


def sglang_record(message: str) -> logging.LogRecord:
    """A record as SGLang's ``logger.info(f"{server_args=}")`` makes it."""
    return logging.LogRecord(
        SGLANG_LOGGER, logging.INFO, "sglang/srt/entrypoints/engine.py", 1, message, None, None
    )


def test_the_server_args_record_goes_to_our_debug_log(caplog):
    with caplog.at_level(logging.DEBUG, logger=OURS):
        assert ServerArgsToDebug().filter(sglang_record(SERVER_ARGS)) is False  # dropped at INFO
        assert ServerArgsToDebug().filter(sglang_record("Using default HuggingFace chat template")) is True
    (kept,) = caplog.records
    assert kept.name == OURS and kept.levelno == logging.DEBUG and SERVER_ARGS in kept.getMessage()


def test_the_filter_is_on_sglang_s_logger_during_the_start_only(caplog):
    logger = logging.getLogger(SGLANG_LOGGER)
    before = list(logger.filters)
    with caplog.at_level(logging.INFO), server_args_at_debug():
        logger.info(SERVER_ARGS)
        logger.info("other news")
    assert [r.getMessage() for r in caplog.records] == ["other news"]
    assert logger.filters == before and logger.level == logging.NOTSET  # nothing else changed


def test_a_start_logs_one_summary_line(caplog, monkeypatch):
    """start_sglang with a fake sglang.Engine that logs its arguments as SGLang does."""

    class Engine:
        def __init__(self, **kwargs) -> None:
            logging.getLogger(SGLANG_LOGGER).info(f"server_args=ServerArgs({kwargs})")

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    cfg = RolloutConfig(dtype="bfloat16", gpu_memory_utilization=0.6)
    kwargs = engine_arguments(cfg, "/tmp/megatron_rl_sglang_x", 2, 0, seed=1, cuda_graph_max_bs=64)
    with caplog.at_level(logging.INFO):
        start_sglang(kwargs, "/models/Qwen2.5-1.5B")
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert line == (
        "SGLang engine: model /models/Qwen2.5-1.5B, TP=2, dtype=bfloat16, mem_fraction_static=0.6, "
        "CUDA graphs up to batch 64, attention_backend=triton"
    )
    off = engine_summary("m", {**kwargs, "disable_cuda_graph": True})
    assert "CUDA graphs off" in off


# A run's end after an SGLang engine: sglang.Engine makes spawn the start method and starts child
# processes (the resource tracker with them, started here directly); its shutdown kills every child
# process. The trainer's step bar is made after the start.
AFTER_AN_ENGINE = """
import multiprocessing as mp
import sys
import types
from multiprocessing import resource_tracker

import psutil


class Engine:
    def __init__(self, **kwargs):
        mp.set_start_method("spawn", force=True)
        resource_tracker.ensure_running()

    def shutdown(self):
        children = psutil.Process().children(recursive=True)
        for child in children:
            child.kill()
        psutil.wait_procs(children, timeout=30)  # a run's exit comes long after


sys.modules["sglang"] = types.SimpleNamespace(Engine=Engine)
from megatron_rl.rollout.sglang_start import start_sglang
from megatron_rl.run.metrics import progress_bar

engine = start_sglang({"tp_size": 1}, "model")
progress_bar(3, 0, enabled=False).close()
engine.shutdown()
print("done")
"""


def test_a_run_after_an_engine_ends_without_a_resource_tracker_traceback(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(AFTER_AN_ENGINE))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert "KeyError" not in out.stderr and "resource_tracker" not in out.stderr, out.stderr


# megatron-core's fallback notices, as a GPU run's rank 0 meets them: hidden, and one line of ours.
MEGATRON_IMPORTS = """
from megatron_rl.parallel import silence_known_notices

silence_known_notices(announce=True)
silence_known_notices(announce=True)  # init_parallel again: no second line
import megatron.core.models.gpt.gpt_layer_specs
import megatron.core.optimizer
import megatron.core.optimizer.clip_grads
"""


def test_megatron_core_fallback_notices_are_one_line_of_ours():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-W", "default", "-c", MEGATRON_IMPORTS]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "not installed" not in out.stderr, out.stderr
    assert out.stdout.splitlines() == [
        "megatron-rl: Transformer Engine not installed: megatron-core runs its local layers and torch's "
        "AdamW (docs/gpu.md)"
    ]


def test_no_line_with_transformer_engine_installed(monkeypatch):
    import importlib.util

    from megatron_rl import parallel

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "transformer_engine" else real(name, *a),
    )
    assert parallel.te_notice() is None
