"""Checkpoint pickles are never executed: malicious legacy files, DCP ``.metadata`` and ``common.pt``
are refused with the file and the offending global named, and the payload never runs."""

import argparse
import enum
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


class Phase(enum.Enum):
    """An enum of the checkpoint's own: plain data, allowed by the opt-in."""

    WARMUP = "warmup"
    MAIN = "main"


class Truncate:
    """The gadget: unpickling this opens ``path`` for writing with zipfile.ZipFile, truncating it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import zipfile

        return (zipfile.ZipFile, (self.path, "w"))


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

    # anything else needs an explicit opt-in by name, and only plain data types can be opted in
    f2 = str(tmp_path / "custom.pt")
    torch.save({"phase": Phase.MAIN}, f2)
    with pytest.raises(UnsafeCheckpointError, match="Phase"):
        safe_torch_load(f2)
    monkeypatch.setenv(SAFE_GLOBALS_ENV, f"{__name__}.Phase")
    assert safe_torch_load(f2)["phase"] is Phase.MAIN
    f3 = str(tmp_path / "state.pt")
    torch.save({"state": CustomState(3)}, f3)
    monkeypatch.setenv(SAFE_GLOBALS_ENV, f"{__name__}.CustomState")
    with pytest.raises(ValueError, match=r"refusing tests\.unit\.test_ckpt_safety\.CustomState, a class"):
        safe_torch_load(f3)


def test_the_zipfile_gadget_is_refused_even_when_opted_in(tmp_path, monkeypatch):
    """MEGATRON_RL_SAFE_GLOBALS=zipfile.ZipFile would let a checkpoint truncate any file it names."""
    victim, control = tmp_path / "victim.bin", tmp_path / "control.bin"
    for f in (victim, control):
        f.write_bytes(os.urandom(1500))
    # the control: unpickled without the loader, the gadget truncates its file
    pickle.loads(pickle.dumps(Truncate(str(control)))).close()
    assert control.stat().st_size < 1500
    ckpt = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": Truncate(str(victim))}, ckpt)
    monkeypatch.setenv(SAFE_GLOBALS_ENV, "zipfile.ZipFile")
    with pytest.raises(ValueError) as e:
        safe_torch_load(ckpt)
    text = str(e.value)
    assert "\n" not in text and "refusing zipfile.ZipFile" in text and SAFE_GLOBALS_ENV in text
    assert victim.stat().st_size == 1500
    monkeypatch.delenv(SAFE_GLOBALS_ENV)
    with pytest.raises(UnsafeCheckpointError, match="zipfile.ZipFile"):
        safe_torch_load(ckpt)
    assert victim.stat().st_size == 1500


@pytest.mark.parametrize(
    "entry",
    ["torch.Tensor", "torch.float16", "torch.Size", "numpy.ndarray", "numpy.float32", "numpy.dtype"],
)
def test_opt_in_takes_tensor_storage_and_dtype_types(monkeypatch, entry):
    from megatron_rl.weights.safe_load import safe_globals

    monkeypatch.setenv(SAFE_GLOBALS_ENV, entry)
    if entry == "torch.float16":  # an instance, not a type
        with pytest.raises(ValueError, match="refusing torch.float16, a dtype"):
            safe_globals()
    else:
        assert any(g.__name__ == entry.rpartition(".")[2] for g in safe_globals() if isinstance(g, type))


@pytest.mark.parametrize(
    "entry, why",
    [
        ("os.system", "not a tensor, storage, dtype"),
        ("posix.system", "not a tensor, storage, dtype"),
        ("builtins.eval", "not a tensor, storage, dtype"),
        ("shutil.rmtree", "not a tensor, storage, dtype"),
        (f"{__name__}.run_anything", "not a tensor, storage, dtype"),
        ("subprocess.Popen", "not a tensor, storage, dtype"),
        ("builtins.object", "not a tensor, storage, dtype"),
        ("os.PathLike", "not a tensor, storage, dtype"),
        ("sys.flags", "not a tensor, storage, dtype"),
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


@pytest.mark.parametrize(
    "verb",
    [
        ["mcore-to-hf", "--ckpt", "{ckpt}", "--out", "{out}"],
        ["legacy-to-dist", "--legacy", "{ckpt}", "--out", "{out}"],
        ["mcore-to-legacy", "--ckpt", "{ckpt}", "--out", "{out}"],
        ["verify", "--hf", "{hf}", "--ckpt", "{ckpt}"],
    ],
    ids=lambda v: v[0],
)
def test_every_ckpt_tools_verb_refuses_a_malicious_checkpoint(hf, tmp_path, verb):
    from ckpt_tools.__main__ import main

    marker = tmp_path / "pwned"
    ckpt = str(tmp_path / "ckpt")
    save_legacy(HFReader(hf), load_model_args(hf), ckpt, tp=1, pp=1)
    f = os.path.join(ckpt, "iter_0000001", "mp_rank_00", LEGACY_FILE)
    state = safe_torch_load(f)
    state["optimizer"] = {"state": {0: Payload(str(marker))}}
    torch.save(state, f)
    argv = [a.format(ckpt=ckpt, out=str(tmp_path / "out"), hf=hf) for a in verb]
    with pytest.raises(UnsafeCheckpointError, match="Refusing to load"):
        main(argv)
    assert not marker.exists(), "the payload ran"
