"""Quiet, truthful logs: an SGLang start logs one line of its arguments (its own dump of them goes to
DEBUG). SGLang is not needed: a fake ``sglang`` module does to the process what ``sglang.Engine`` does."""

from __future__ import annotations

import logging
import sys
import types

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.sglang_engine import (
    ServerArgsToDebug,
    engine_arguments,
    engine_summary,
    server_args_at_debug,
    start_sglang,
)

SGLANG_LOGGER = "sglang.srt.entrypoints.engine"
OURS = "megatron_rl.rollout.sglang_engine"
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
