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
    from megatron_rl.models.hf import load_model_args
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

    from megatron_rl.models.hf import load_model_args
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.weights.megatron_ckpt import save_legacy

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
