"""Checkpoint integrity: every file a save writes is listed with its size and SHA-256 in checksums.json
(written last, before the directory is published), and a damaged, truncated, empty or missing file is
refused before use, in one line naming it, by the trainer's resume and by ckpt_tools. A checkpoint
without a manifest (saved before digests existed) still loads, with one log line.

The checkpoint is a real trainer save (CheckpointManager.save of a 1-layer Llama, megatron-core
torch_dist) in a gloo world of one; each test damages its own copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pytest
import torch

from megatron_rl.errors import CheckpointError
from megatron_rl.run import explain as ex
from megatron_rl.run.checkpoint import CheckpointManager
from megatron_rl.weights.digests import DIGESTS_FILE


@pytest.fixture(scope="module")
def saved(ps, tmp_path_factory):
    """(global_step_1 of a trainer save, the model saved, a function building a fresh one)."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.random_hf import save_random_hf_model

    base = tmp_path_factory.mktemp("digests")
    hf = save_random_hf_model(str(base / "hf"), "llama", num_hidden_layers=1)
    args = load_model_args(hf)

    def fresh():
        return build_model(args, ps, "actor", dtype=torch.float32)

    model = fresh()
    load_hf_weights(model, hf, ps)
    manager = CheckpointManager(str(base / "run"), ps, claim=True)
    path = manager.save(1, {"actor": model}, {}, {"counters": {"n": 3}}, {"note": "x"})
    manager.release()
    return path, model, fresh


@pytest.fixture
def copy(saved, tmp_path):
    """A copy of the saved checkpoint, in a run directory of its own, that the test may damage."""
    dst = tmp_path / "run" / "global_step_1"
    shutil.copytree(saved[0], dst)
    return dst


def _load(ps, path, model):
    return CheckpointManager(str(path.parent), ps).load(str(path), {"actor": model}, {})


def _distcp(path):
    return sorted((path / "actor").glob("*.distcp"))[0]


def _flip(f, at=None):
    data = bytearray(f.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    f.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_of_the_save(saved):
    path = saved[0]
    with open(os.path.join(path, DIGESTS_FILE)) as f:
        body = json.load(f)
    files = {
        os.path.relpath(os.path.join(top, f), path)
        for top, _, names in os.walk(path)
        for f in names
        if f != DIGESTS_FILE
    }
    assert body["algorithm"] == "sha256" and set(body["files"]) == files
    assert {"trainer_state.json", "mp_rank_00_000.pt", "actor/.metadata", "actor/megatron_rl.json"} <= files
    assert any(f.startswith("actor/") and f.endswith(".distcp") for f in files)
    for rel, entry in body["files"].items():
        with open(os.path.join(path, rel), "rb") as f:
            data = f.read()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert not [f for f in os.listdir(path) if f.endswith(".tmp")]


@pytest.mark.parametrize(
    "damage, what",
    [
        ("flip", "is damaged (its sha256 differs from the one {manifest} recorded at save)"),
        ("truncate", "is truncated ("),
        ("empty", "is empty (0 bytes, "),
        ("missing", "is missing (listed in {manifest}, written at save)"),
    ],
)
def test_a_damaged_file_is_refused_by_the_trainers_load(ps, saved, copy, damage, what):
    """One line naming the file and the fix, the same the launcher prints; nothing is loaded."""
    f = _distcp(copy)
    if damage == "flip":
        _flip(f)
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-7])
    elif damage == "empty":
        f.write_bytes(b"")
    else:
        f.unlink()
    model = saved[2]()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with pytest.raises(CheckpointError) as e:
        _load(ps, copy, model)
    msg = ex.explain(e.value)
    assert msg == str(e.value) and "\n" not in msg, msg
    assert msg.startswith(f"checkpoint file {f} "), msg
    assert what.format(manifest=copy / DIGESTS_FILE) in msg, msg
    assert "restore it from a copy" in msg and "trainer.resume_mode=disable" in msg, msg
    assert not any(p.any() for p in model.parameters())  # nothing was read into the model


def test_a_damaged_trainer_state_is_refused_before_its_values_are_used(ps, saved, copy):
    """The registry reads trainer_state.json first (the training data's fingerprint): checked before
    that too; the fix names the other complete checkpoint of the directory."""
    from megatron_rl.run.state import StateRegistry

    other = copy.parent / "global_step_0"
    shutil.copytree(copy, other)
    _flip(copy / "trainer_state.json", at=2)
    reg = StateRegistry()
    reg.register_model("actor", saved[2](), None)
    with pytest.raises(CheckpointError) as e:
        reg.load(CheckpointManager(str(copy.parent), ps), str(copy))
    msg = str(e.value)
    assert msg.startswith(f"checkpoint file {copy / 'trainer_state.json'} is damaged"), msg
    assert f"trainer.resume_from_path={other}" in msg, msg


def test_a_checkpoint_without_manifest_still_loads(ps, saved, copy, caplog):
    (copy / DIGESTS_FILE).unlink()
    model = saved[2]()
    with caplog.at_level(logging.INFO, logger="megatron_rl.run.ckpt_files"):
        shards, state = _load(ps, copy, model)
    assert shards["counters"] == {"n": 3} and state["note"] == "x"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved[1].parameters(), strict=True))
    said = [r.getMessage() for r in caplog.records if DIGESTS_FILE in r.getMessage()]
    want = f"{copy} has no {DIGESTS_FILE} (saved before checkpoints carried digests): loading it without"
    assert said == [want + " a digest check"], caplog.text


def test_an_intact_checkpoint_loads_and_a_damaged_manifest_is_named(ps, saved, copy):
    model = saved[2]()
    _load(ps, copy, model)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved[1].parameters(), strict=True))
    (copy / DIGESTS_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"the checksum manifest {copy / DIGESTS_FILE} is damaged"):
        _load(ps, copy, model)


def test_ckpt_tools_refuses_a_damaged_distcp_and_checks_what_it_wrote(ps, copy, tmp_path, capsys):
    """mcore-to-hf of the trainer checkpoint's actor/ refuses a flipped byte (rc 1, one line naming the
    file, no output); from the intact copy it writes an HF model with its own manifest, and a truncated
    safetensors file of that output is refused by the next verb that reads it."""
    from ckpt_tools.__main__ import main

    out = tmp_path / "hf_out"
    damaged = tmp_path / "damaged" / "global_step_1"
    shutil.copytree(copy, damaged)
    f = _distcp(damaged)
    _flip(f)
    assert main(["mcore-to-hf", "--ckpt", str(damaged / "actor"), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    manifest = damaged / DIGESTS_FILE
    want = f"ckpt_tools: checkpoint file {f} is damaged (its sha256 differs from the one {manifest} recorded"
    assert err[-1].startswith(want + " at save): restore the file from a copy"), err
    assert not out.exists()

    assert main(["mcore-to-hf", "--ckpt", str(copy / "actor"), "--out", str(out)]) == 0
    listed = json.loads((out / DIGESTS_FILE).read_text())["files"]
    assert set(listed) == {p for p in os.listdir(out) if p != DIGESTS_FILE} and "model.safetensors" in listed
    st = out / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    legacy = tmp_path / "legacy"
    assert main(["mcore-to-legacy", "--ckpt", str(out), "--out", str(legacy)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ckpt_tools: checkpoint file {st} is truncated (100 bytes, "), err
    assert not legacy.exists()
