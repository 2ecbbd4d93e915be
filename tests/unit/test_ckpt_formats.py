"""Format detection, architecture discovery and legacy Megatron-LM files (single process, real files)."""

import argparse
import dataclasses
import json
import os
import shutil
from io import BytesIO

import pytest
import torch

from megatron_rl.model_args import load_model_args
from megatron_rl.models.loading import detect_format, load_model_args_any, open_reader
from megatron_rl.weights.ckpt_format import LEGACY_FILE, METADATA_FILE, TE_NORM_NAMES, TRACKER_FILE
from megatron_rl.weights.ckpt_write import save_legacy
from megatron_rl.weights.hf_io import HFReader
from megatron_rl.weights.megatron_args import megatron_args_from_model_args, model_args_from_megatron_args
from megatron_rl.weights.safe_load import safe_torch_load

ARCHS = {"llama": False, "qwen2": True, "qwen3": False, "phi3": False}  # arch -> tied embeddings


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from megatron_rl.models.random_hf import save_random_hf_model

    root = tmp_path_factory.mktemp("hf")
    return {
        a: save_random_hf_model(str(root / a), a, seed=i, tie_word_embeddings=t)
        for i, (a, t) in enumerate(ARCHS.items())
    }


def dims(args):
    """Every architectural field except the vocabulary (Megatron-LM pads it) and the raw config."""
    d = dataclasses.asdict(args)
    d.pop("hf_config")
    d.pop("vocab_size")
    return d


@pytest.mark.parametrize("arch", list(ARCHS))
def test_legacy_round_trip_is_bit_exact(hf_dirs, tmp_path, arch):
    """HF -> legacy TP2 x PP2 (vocab padded to 128 x TP, as Megatron-LM does) -> HF tensors, exactly."""
    hf = hf_dirs[arch]
    args = load_model_args(hf)
    out = str(tmp_path / "ckpt")
    save_legacy(HFReader(hf), args, out, tp=2, pp=2, iteration=3)

    assert detect_format(out) == "legacy"
    it = os.path.join(out, "iter_0000003")
    assert sorted(os.listdir(it)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    first = safe_torch_load(os.path.join(it, "mp_rank_00_000", LEGACY_FILE))
    last = safe_torch_load(os.path.join(it, "mp_rank_01_001", LEGACY_FILE))
    # Megatron-LM layout: local layer indices on every stage, vocabulary padded, args inside.
    assert {k.split(".")[2] for k in last["model"] if k.startswith("decoder.layers.")} == {"0", "1"}
    assert first["model"]["embedding.word_embeddings.weight"].shape[0] == 128  # 256 rows over 2 ranks
    assert last["args"].tensor_model_parallel_size == 2 and last["iteration"] == 3

    # No config.json anywhere near: the architecture comes from the saved args Namespace.
    from_ns = load_model_args_any(out)
    # Phi-3 is Llama math with fused HF tensors; Megatron-LM args cannot tell them apart.
    assert dims(from_ns) == {**dims(args), "arch": "llama" if arch == "phi3" else arch}
    assert from_ns.vocab_size == 256

    reader = open_reader(out, args)
    ref = HFReader(hf)
    assert sorted(reader.keys()) == sorted(ref.keys())
    for name in ref.keys():
        assert torch.equal(reader.get(name), ref.get(name)), name


def test_config_beside_takes_precedence_and_missing_metadata_error(hf_dirs, tmp_path):
    hf = hf_dirs["llama"]
    args = load_model_args(hf)
    root = tmp_path / "run"
    out = str(root / "ckpt")
    save_legacy(HFReader(hf), args, out, tp=1, pp=2, with_args=False)
    assert detect_format(out) == "legacy"
    with pytest.raises(FileNotFoundError) as e:
        load_model_args_any(out)
    msg = str(e.value)
    assert "config.json" in msg and os.path.abspath(out) in msg and "megatron_rl.json" in msg

    # an HF config.json in the parent directory (or beside) describes the checkpoint
    shutil.copy(os.path.join(hf, "config.json"), root / "config.json")
    assert load_model_args_any(out) == args
    # the iteration directory itself is accepted too
    assert detect_format(os.path.join(out, "iter_0000001")) == "legacy"


def test_detect_format_errors(hf_dirs, tmp_path):
    assert detect_format(hf_dirs["llama"]) == "hf"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as e:
        detect_format(str(empty))
    for looked_for in ("config.json", "safetensors", "metadata.json", "mp_rank_", TRACKER_FILE):
        assert looked_for in str(e.value)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        detect_format(str(tmp_path / "nope"))

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(os.path.join(hf_dirs["llama"], "config.json"), bin_dir)
    (bin_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors"):
        detect_format(str(bin_dir))

    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / TRACKER_FILE).write_text("42")
    with pytest.raises(FileNotFoundError, match="iter_0000042"):
        detect_format(str(stale))


def test_megatron_args_mapping(hf_dirs):
    for arch in ("llama", "qwen2", "qwen3"):
        args = load_model_args(hf_dirs[arch])
        ns = megatron_args_from_model_args(args, 2, 1, 128, torch.bfloat16)
        back = model_args_from_megatron_args(ns, "test")
        assert dims(back) == dims(args), arch
        assert back.vocab_size == 128 and back.hf_config["dtype"] == "bfloat16"
    ns = megatron_args_from_model_args(load_model_args(hf_dirs["llama"]), 1, 1, 128, torch.float32)
    for change, word in (
        ({"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
        ({"num_experts": 8}, "num_experts"),
        ({"normalization": "LayerNorm"}, "RMSNorm"),
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"swiglu": False}, "SwiGLU"),
    ):
        bad = argparse.Namespace(**{**vars(ns), **change})
        with pytest.raises(ValueError, match=word):
            model_args_from_megatron_args(bad, "ckpt/mp_rank_00/model_optim_rng.pt")


def test_legacy_transformer_engine_names_and_mismatch(hf_dirs, tmp_path):
    """Megatron-LM checkpoints made with TE name the norms after the fused linear layers and carry
    ``_extra_state`` entries (BytesIO); they read the same. A config of another model is refused."""
    hf = hf_dirs["qwen3"]
    args = load_model_args(hf)
    out = str(tmp_path / "te")
    save_legacy(HFReader(hf), args, out, tp=2, pp=1)
    for t in range(2):
        f = os.path.join(out, "iter_0000001", f"mp_rank_{t:02d}", LEGACY_FILE)
        state = safe_torch_load(f)
        renamed = {}
        for k, v in state["model"].items():
            for local, te in TE_NORM_NAMES.items():
                k = k.replace(local, te)
            renamed[k] = v
            if k.endswith("linear_qkv.weight"):
                renamed[k.replace("weight", "_extra_state")] = BytesIO(b"te-fp8-meta")
        state["model"] = renamed
        torch.save(state, f)
    reader = open_reader(out, args)
    ref = HFReader(hf)
    for name in ref.keys():
        assert torch.equal(reader.get(name), ref.get(name)), name

    other = load_model_args(hf_dirs["llama"])
    with pytest.raises(ValueError, match="does not match"):
        open_reader(out, other)
    fewer = dataclasses.replace(args, num_layers=2)
    with pytest.raises(ValueError, match="the model config says 2"):
        open_reader(out, fewer)


def test_uneven_pipeline_stages(hf_dirs, tmp_path):
    """Megatron-LM may put 3 layers on one stage and 1 on the other; offsets come from the files."""
    hf = hf_dirs["llama"]
    args = load_model_args(hf)
    out = str(tmp_path / "uneven")
    save_legacy(HFReader(hf), args, out, tp=1, pp=2)
    it = os.path.join(out, "iter_0000001")
    s0 = safe_torch_load(os.path.join(it, "mp_rank_00_000", LEGACY_FILE))
    s1 = safe_torch_load(os.path.join(it, "mp_rank_00_001", LEGACY_FILE))
    # move global layer 2 (stage 1, local 0) to stage 0 as local 2; stage 1 keeps global 3 as local 0
    for k in [k for k in s1["model"] if k.startswith("decoder.layers.")]:
        v = s1["model"].pop(k)
        i = int(k.split(".")[2])
        rest = k.split(".", 3)[3]
        if i == 0:
            s0["model"][f"decoder.layers.2.{rest}"] = v
        else:
            s1["model"][f"decoder.layers.0.{rest}"] = v
    torch.save(s0, os.path.join(it, "mp_rank_00_000", LEGACY_FILE))
    torch.save(s1, os.path.join(it, "mp_rank_00_001", LEGACY_FILE))
    reader = open_reader(out, args)
    assert reader.offsets == [0, 3, 4]
    ref = HFReader(hf)
    for name in ref.keys():
        assert torch.equal(reader.get(name), ref.get(name)), name


def test_our_metadata_names_the_architecture(hf_dirs, tmp_path):
    """A directory with a torch_dist marker and our megatron_rl.json: the JSON's HF config is used."""
    d = tmp_path / "td"
    d.mkdir()
    (d / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    with open(os.path.join(hf_dirs["qwen2"], "config.json")) as f:
        cfg = json.load(f)
    (d / METADATA_FILE).write_text(json.dumps({"role": "actor", "hf_config": cfg}))
    assert detect_format(str(d)) == "torch_dist"
    assert load_model_args_any(str(d)) == load_model_args(hf_dirs["qwen2"])


def test_write_hf_in_several_shards(hf_dirs, tmp_path):
    """Streaming HF export with a small shard size: an index, and transformers loads the result."""
    from transformers import AutoModelForCausalLM

    from ckpt_tools.hf_writer import parse_size, write_hf

    assert parse_size("2GB") == 2 << 30 and parse_size("500MB") == 500 << 20 and parse_size("123") == 123
    hf = hf_dirs["qwen2"]  # tied embeddings: no lm_head tensor in HF
    out = str(tmp_path / "sharded")
    files = write_hf(
        HFReader(hf), load_model_args(hf), out, max_shard_bytes=parse_size("40KB"), progress=False
    )
    assert len(files) > 2 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    ref = HFReader(hf)
    got = HFReader(out)
    assert sorted(got.keys()) == sorted(ref.keys())
    for name in ref.keys():
        assert torch.equal(got.get(name), ref.get(name)), name
    ids = torch.arange(10).view(1, 10)
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    assert torch.equal(a, b)
