"""Checkpoint digests across ranks: at EP=2 each rank writes (and hashes) its own experts' files, the
manifest covers both, and a flipped byte in one rank's ``.distcp`` is refused on every rank by the
trainer's load and by ``ckpt_tools mcore-to-hf`` (which exported such a file with rc 0 before digests),
in one line naming the file."""

import os

from tests.conftest import run_torchrun


def test_a_flipped_byte_in_an_ep2_shard_is_refused_everywhere(tmp_path, capsys):
    from ckpt_tools.__main__ import main
    from megatron_rl.models.random_hf import save_random_hf_model

    hf = save_random_hf_model(str(tmp_path / "hf"), "qwen3_moe", seed=5, num_hidden_layers=2)
    root = tmp_path / "run"
    out = run_torchrun("ckpt_digests.py", 2, ["--hf", hf, "--root", str(root)], timeout=300)
    lines = out.splitlines()
    listed = __import__("json").loads(next(ln for ln in lines if ln.startswith("LISTED "))[7:])
    assert any(f.startswith("actor/__0_") for f in listed) and any(f.startswith("actor/__1_") for f in listed)
    refused = sorted(ln for ln in lines if ln.startswith("rank"))
    assert [ln.split(" ", 2)[:2] for ln in refused] == [["rank0", "REFUSED"], ["rank1", "REFUSED"]], out
    msg0, msg1 = (ln.split(" ", 2)[2] for ln in refused)
    assert msg0 == msg1 and "\n" not in msg0
    step = root / "global_step_1"
    assert msg0.startswith(f"checkpoint file {step}/actor/__1_") and " is damaged (its sha256 differs" in msg0
    damaged = msg0.split()[2]

    hf_out = tmp_path / "hf_out"
    assert main(["mcore-to-hf", "--ckpt", str(step / "actor"), "--out", str(hf_out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ckpt_tools: checkpoint file {damaged} is damaged"), err
    assert not os.path.exists(hf_out)
