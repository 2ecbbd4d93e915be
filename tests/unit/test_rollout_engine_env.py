"""The SGLang engine start hides torchrun's variables, restores them, and never overlaps another start."""

from __future__ import annotations

import os
import threading

import pytest

from megatron_rl.rollout.sglang_start import torchrun_env_hidden

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"}


@pytest.fixture
def torchrun_env(monkeypatch):
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OTHER_VAR", "kept")


def test_hidden_inside_restored_after(torchrun_env):
    with torchrun_env_hidden():
        assert not any(k in os.environ for k in TORCHRUN)
        assert os.environ["OTHER_VAR"] == "kept"
    assert {k: os.environ[k] for k in TORCHRUN} == TORCHRUN


def test_restored_when_the_start_fails(torchrun_env):
    with pytest.raises(ValueError), torchrun_env_hidden():
        raise ValueError("engine failed to start")
    assert {k: os.environ[k] for k in TORCHRUN} == TORCHRUN


def test_two_starts_do_not_overlap(torchrun_env):
    first_in, release, second_in = threading.Event(), threading.Event(), threading.Event()
    seen_by_second: dict[str, str | None] = {}

    def first() -> None:
        with torchrun_env_hidden():
            first_in.set()
            release.wait(10)

    def second() -> None:
        first_in.wait(10)
        with torchrun_env_hidden():
            second_in.set()
            seen_by_second.update({k: os.environ.get(k) for k in TORCHRUN})

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start()
    b.start()
    assert first_in.wait(10)
    # the second start waits for the first: otherwise it would save an already hidden environment
    assert not second_in.wait(0.3)
    release.set()
    a.join(10)
    b.join(10)
    assert second_in.is_set()
    assert seen_by_second == dict.fromkeys(TORCHRUN)  # hidden during the second start too
    assert {k: os.environ[k] for k in TORCHRUN} == TORCHRUN  # and everything back after both
