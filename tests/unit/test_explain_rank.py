"""The rank an explained failure names: torch.distributed's, or torchrun's RANK as the process started."""

from __future__ import annotations

import torch.distributed as dist

from megatron_rl.rollout.sglang_start import torchrun_env_hidden
from megatron_rl.run import explain as ex

NO_GPU = RuntimeError("trainer.device=cuda but no GPU is visible: set trainer.device=cpu or auto.")


def test_rank_named_while_an_engine_start_hides_rank(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(
        ex, "_LAUNCH_ENV", {"RANK": "5"}, raising=False
    )  # what torchrun set when the process started
    with torchrun_env_hidden():
        assert ex.explain(NO_GPU).startswith("rank 5 on ")


def test_rank_comes_from_torch_distributed_once_initialized(monkeypatch):
    monkeypatch.setenv("RANK", "7")  # a job rank; this process's world (a placement's) numbers it 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert ex.explain(NO_GPU).startswith("rank 0 on ")
    finally:
        dist.destroy_process_group()


def test_rank_unknown_without_either(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(ex, "_LAUNCH_ENV", {}, raising=False)
    assert ex.explain(NO_GPU).startswith("a rank on ")
