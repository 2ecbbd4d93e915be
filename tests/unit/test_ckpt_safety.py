"""Checkpoint pickles are never executed: malicious legacy files, DCP ``.metadata`` and ``common.pt``
are refused with the file and the offending global named, and the payload never runs."""

import argparse
import json
import os
import pickle
import signal
from dataclasses import dataclass
from pathlib import PosixPath

import numpy as np
import pytest
import torch

from megatron_rl.model_args import load_model_args
from megatron_rl.models.loading import detect_format, load_model_args_any, open_reader
from megatron_rl.weights.ckpt_format import LEGACY_FILE
from megatron_rl.weights.ckpt_write import save_legacy
from megatron_rl.weights.hf_io import HFReader
from megatron_rl.weights.safe_load import (
    SAFE_GLOBALS_ENV,
    UnsafeCheckpointError,
    check_torch_dist,
    read_dcp_metadata,
    safe_torch_load,
)


class Payload:
    """Unpickling this runs a shell command (what a booby-trapped checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def run_anything(cmd: str) -> int:
    """A function: never allowed by the opt-in (unpickling calls it with the file's arguments)."""
    return os.system(cmd)


@dataclass
class CustomState:
    step: int


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    return save_random_hf_model(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", num_hidden_layers=2)


def test_malicious_legacy_checkpoint_is_refused(hf, tmp_path):
    marker = tmp_path / "pwned"
    out = str(tmp_path / "ckpt")
    args = load_model_args(hf)
    save_legacy(HFReader(hf), args, out, tp=1, pp=1)
    f = os.path.join(out, "iter_0000001", "mp_rank_00", LEGACY_FILE)
    state = safe_torch_load(f)
    state["optimizer"] = {"state": {0: Payload(str(marker))}}
    torch.save(state, f)

    assert detect_format(out) == "legacy"
    with pytest.raises(UnsafeCheckpointError) as e:
        load_model_args_any(out)  # reads the saved args from this file
    msg = str(e.value)
    assert f in msg and "system" in msg and "not allowed" in msg and "Re-save" in msg
    assert SAFE_GLOBALS_ENV not in msg, "the refusal must not advertise the opt-in"
    with pytest.raises(UnsafeCheckpointError):
        open_reader(out, args)  # loading the weights with a config.json at hand opens the same file
    assert not marker.exists(), "the payload ran"


def test_malicious_torch_dist_pickles_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    d = tmp_path / "td"
    d.mkdir()
    (d / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    # DCP reads .metadata with plain pickle.load; megatron-core reads common.pt with torch.load.
    (d / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    assert detect_format(str(d)) == "torch_dist"
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*system"):
        read_dcp_metadata(str(d))
    with pytest.raises(UnsafeCheckpointError):
        load_model_args_any(str(d))  # no metadata / config.json: would read args from common.pt

    (d / ".metadata").unlink()
    torch.save({"args": Payload(str(marker))}, d / "common.pt")
    (d / ".metadata").write_bytes(pickle.dumps({"plain": [1, 2]}))  # benign, so common.pt is reached
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt"):
        check_torch_dist(str(d))
    assert not marker.exists(), "the payload ran"


def test_what_megatron_lm_saves_is_allowed(tmp_path, monkeypatch):
    """args Namespace with megatron enums, signals, paths, numpy scalars; numpy RNG states; BytesIO."""
    from io import BytesIO

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    f = str(tmp_path / "ok.pt")
    ns = argparse.Namespace(
        attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
        exit_signal=signal.SIGTERM,
        save=PosixPath("/ckpt"),
        lr=np.float64(3e-4),
        params_dtype=torch.bfloat16,
    )
    torch.save({"args": ns, "np": np.random.get_state(), "te": BytesIO(b"x"), "w": torch.ones(2)}, f)
    out = safe_torch_load(f)
    assert out["args"].attention_backend == AttnBackend.auto and out["args"].lr == 3e-4

    # anything else needs an explicit opt-in by name
    f2 = str(tmp_path / "custom.pt")
    torch.save({"state": CustomState(3)}, f2)
    with pytest.raises(UnsafeCheckpointError, match="CustomState"):
        safe_torch_load(f2)
    monkeypatch.setenv(SAFE_GLOBALS_ENV, f"{__name__}.CustomState")
    assert safe_torch_load(f2)["state"].step == 3


@pytest.mark.parametrize(
    "entry, why",
    [
        ("os.system", "not a class"),
        ("posix.system", "not a class"),
        ("builtins.eval", "not a class"),
        ("shutil.rmtree", "not a class"),
        (f"{__name__}.run_anything", "not a class"),
        ("subprocess.Popen", "comes from subprocess"),
        ("builtins.object", "comes from builtins"),
        ("os.PathLike", "comes from os"),
        ("sys.flags", "not a class"),
    ],
)
def test_opt_in_accepts_plain_classes_only(tmp_path, monkeypatch, entry, why):
    """MEGATRON_RL_SAFE_GLOBALS cannot open the door to code: functions, callables and classes from
    os / subprocess / builtins / ... are refused before any file is read, and the payload never runs."""
    marker = tmp_path / "pwned"
    f = str(tmp_path / "evil.pt")
    torch.save({"x": Payload(str(marker))}, f)
    monkeypatch.setenv(SAFE_GLOBALS_ENV, entry)
    with pytest.raises(ValueError, match=why) as e:
        safe_torch_load(f)
    assert SAFE_GLOBALS_ENV in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists(), "the payload ran"
    # without the opt-in the same file is refused as unsafe, naming os.system / posix.system
    monkeypatch.delenv(SAFE_GLOBALS_ENV)
    with pytest.raises(UnsafeCheckpointError, match="system.*not allowed"):
        safe_torch_load(f)
    assert not marker.exists(), "the payload ran"
