"""The ckpt_tools command line: help for every verb; the single-process mcore-to-legacy verb."""

import os
import subprocess
import sys

import pytest
import torch

from ckpt_tools.__main__ import VERBS, main
from megatron_rl.weights.hf_io import HFReader
from tests.conftest import ROOT


def test_help_lists_every_verb():
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_tools", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for verb in VERBS:
        assert verb in proc.stdout
    assert set(VERBS) == {
        "hf-to-mcore",
        "mcore-to-hf",
        "legacy-to-dist",
        "reshard",
        "mcore-to-legacy",
        "export-peft",
        "verify",
    }


@pytest.mark.parametrize("verb", list(VERBS))
def test_verb_help(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m ckpt_tools " + verb) and "example:" in out


def test_mcore_to_legacy_from_hf(tmp_path):
    """HF -> legacy TP2 x PP2 through the command line; read back exactly."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.loading import open_reader
    from megatron_rl.models.random_hf import save_random_hf_model

    hf = save_random_hf_model(str(tmp_path / "hf"), "qwen2", tie_word_embeddings=True)
    out = str(tmp_path / "legacy")
    assert (
        main(["mcore-to-legacy", "--ckpt", hf, "--out", out, "--tp", "2", "--pp", "2", "--iteration", "5"])
        == 0
    )
    assert os.path.isdir(os.path.join(out, "iter_0000005", "mp_rank_01_001"))
    reader, ref = open_reader(out, load_model_args(hf)), HFReader(hf)
    for name in ref.keys():
        assert torch.equal(reader.get(name), ref.get(name)), name


def test_mcore_to_hf_from_megatron_lm_args(tmp_path):
    """A legacy checkpoint described only by its saved args exports to an HF model (config written
    from the args, vocabulary kept padded) that transformers loads and that computes the same logits."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.weights.ckpt_write import save_legacy

    hf = save_random_hf_model(str(tmp_path / "hf"), "qwen3")
    legacy, out = str(tmp_path / "run" / "legacy"), str(tmp_path / "run" / "hf_out")
    save_legacy(HFReader(hf), load_model_args(hf), legacy, tp=2, pp=2)
    assert main(["mcore-to-hf", "--ckpt", legacy, "--out", out]) == 0
    ids = torch.arange(12).view(2, 6)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    assert got.shape[-1] == 256 and not got[..., 99:].any()  # padding rows are zero
    torch.testing.assert_close(got[..., :99], ref, rtol=0, atol=1e-5)


def test_out_is_refused_when_not_empty_and_replaced_whole_with_overwrite(tmp_path, capsys):
    """A non-empty --out needs --overwrite (one line naming both); with it, the old contents are gone
    (no TP2 x PP2 shard of the first conversion stays beside the TP1 ones) and no staging is left."""
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.loading import open_reader
    from megatron_rl.models.random_hf import save_random_hf_model

    hf = save_random_hf_model(str(tmp_path / "hf"), "qwen2", tie_word_embeddings=True)
    out = tmp_path / "legacy"
    assert main(["mcore-to-legacy", "--ckpt", hf, "--out", str(out), "--tp", "2", "--pp", "2"]) == 0
    (out / "notes.txt").write_text("from an earlier conversion")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))

    again = ["mcore-to-legacy", "--ckpt", hf, "--out", str(out), "--tp", "1", "--pp", "1"]
    with pytest.raises(SystemExit) as e:
        main(again)
    msg = str(e.value.code)
    assert "\n" not in msg and f"--out {out}" in msg and "--overwrite" in msg, msg
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # untouched

    assert main([*again, "--overwrite"]) == 0
    assert f"wrote legacy Megatron-LM checkpoint {out} " in capsys.readouterr().out  # not the staging path
    assert not (out / "notes.txt").exists() and not (out / "iter_0000001" / "mp_rank_01_001").exists()
    assert sorted(os.listdir(out / "iter_0000001")) == ["mp_rank_00"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
    reader, ref = open_reader(str(out), load_model_args(hf)), HFReader(hf)
    for name in ref.keys():
        assert torch.equal(reader.get(name), ref.get(name)), name


def test_failed_verb_leaves_out_untouched(tmp_path, capsys):
    """A conversion that fails midway (here: no such checkpoint) changes nothing at --out, and says why
    in one line (exit 1)."""
    out = tmp_path / "hf_out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["mcore-to-hf", "--ckpt", str(tmp_path / "missing"), "--out", str(out), "--overwrite"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ckpt_tools: ") and "missing" in err and "\n" not in err, err
    assert sorted(os.listdir(out)) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
