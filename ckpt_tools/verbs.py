"""The verbs. Each takes the parsed arguments (with ``argv``, for re-launching) and returns an exit code.

Data flow:

* ``hf-to-mcore`` / ``legacy-to-dist`` / ``reshard``: TP x PP gloo ranks; each builds its stage of
  the model, fills its shard (HF slices / merged legacy shards / dist_checkpointing resharding) and
  ``save_torch_dist`` writes the checkpoint collectively.
* ``mcore-to-hf`` / ``mcore-to-legacy``: one process streams HF tensors out of the checkpoint, one
  layer at a time, into safetensors shards / legacy mp_rank files.
* ``export-peft``: one process reads a LoRA checkpoint's adapters (never the base) and writes PEFT's
  adapter files, or streams the base's HF tensors with the adapters merged into an HF directory.
* ``verify``: TP x PP ranks run the Megatron model from any format; the last stage compares its
  logits with the HF model's on the same random tokens.

Every verb first checks each file of its input against the ``checksums.json`` written when the input
was saved (:func:`_check_digests`); the outputs get theirs from staging.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

from ckpt_tools.launch import RESULT_ENV, relaunch_if_needed, require_single_process
from ckpt_tools.staging import shown_out

# torch is imported inside the verbs: a process that only re-launches itself under torchrun stays light.


def _dtype(name: str):
    from megatron_rl.model_args import DTYPES

    return DTYPES[name]


def _config_dtype(args):
    name = str(args.hf_config.get("dtype") or args.hf_config.get("torch_dtype") or "float32")
    name = name.replace("torch.", "")
    return _dtype(name if name in ("float32", "bfloat16", "float16") else "float32")


def _say(ps, msg: str) -> None:
    if ps is None or ps.rank == 0:
        print(msg, flush=True)


@contextlib.contextmanager
def _parallel(tp: int, pp: int, needed: bool = True, ep: int = 1) -> Iterator:
    """init_parallel on the CPU for the verb's duration (None when not ``needed``); a process group
    that the caller started stays up afterwards."""
    if not needed:
        yield None
        return
    import torch.distributed as dist

    from megatron_rl.parallel import destroy_parallel, init_parallel

    owned = not dist.is_initialized()
    ps = init_parallel(tp, pp, device="cpu", ep=ep)
    try:
        yield ps
    finally:
        if owned:
            destroy_parallel()


def _check_digests(path: str, quiet: bool = False) -> None:
    """Every file of the checkpoint at ``path`` against its manifest, before anything reads it: a missing,
    truncated or damaged file stops the verb in one line naming it. Done once, by the process the user
    started (its re-launched ranks skip it); a checkpoint without a manifest is read unchecked, with a
    note unless ``quiet`` (HF inputs: a downloaded model has no manifest)."""
    from megatron_rl.weights.digests import DIGESTS_FILE, verify_checkpoint

    if os.environ.get(RESULT_ENV) or not os.path.isdir(path):
        return
    fix = "restore the file from a copy, or convert an earlier checkpoint (another global_step_N)"
    if verify_checkpoint(path, fix) is None and not quiet:
        print(
            f"ckpt_tools: note: {path} has no {DIGESTS_FILE} (saved before checkpoints carried digests, or "
            "by another tool): reading it without a digest check",
            file=sys.stderr,
            flush=True,
        )


def _side_dirs(path: str) -> list[str]:
    from megatron_rl.weights.ckpt_format import locate_megatron_checkpoint

    loc = locate_megatron_checkpoint(path)
    dirs = [path] if loc is None else [loc.ckpt_dir, loc.root]
    return [*dirs, os.path.dirname(os.path.abspath(dirs[-1]))]


def _check_layout(path: str, tp: int, pp: int, vpp: int = 1) -> None:
    """The trainer's layout check, before any rank starts: ``--tp`` must divide the model's heads,
    ``--pp`` its layers and ``--vpp`` each stage's (one line instead of N ranks failing)."""
    from megatron_rl.config import ConfigError, check_layout_against_model
    from megatron_rl.models.loading import load_model_args_any

    args = load_model_args_any(path)
    dims = {"num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads}
    try:
        check_layout_against_model(
            {**dims, "num_layers": args.num_layers}, tp, pp, tp_key="--tp", pp_key="--pp", vpp=vpp
        )
    except ConfigError as e:
        msg = str(e).replace("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", "--vpp")
        msg = msg.replace(" pipeline_model_parallel_size or", " --pp or")
        raise SystemExit(f"ckpt_tools: {path}: {msg}") from None


def _chunks(a: argparse.Namespace):
    """The build options of ``--vpp`` (model chunks per pipeline stage)."""
    from megatron_rl.models.builder import TrainingOptions

    return TrainingOptions(virtual_pipeline=a.vpp)


def _check_experts(path: str, ep: int) -> None:
    """``--ep`` must divide a mixture-of-experts model's experts (and is 1 for a dense model)."""
    from megatron_rl.models.loading import load_model_args_any

    args = load_model_args_any(path)
    if ep < 1 or (args.is_moe and args.num_experts % ep) or (not args.is_moe and ep != 1):
        what = f"its {args.num_experts} experts" if args.is_moe else "a dense model (use --ep 1)"
        raise SystemExit(f"ckpt_tools: {path}: --ep {ep} does not divide {what}")


def _legacy(path: str):
    from megatron_rl.weights.ckpt_format import LEGACY_FILE, locate_megatron_checkpoint
    from megatron_rl.weights.legacy import LegacyCheckpoint

    loc = locate_megatron_checkpoint(path)
    if loc is None or loc.format != "legacy":
        raise SystemExit(f"{path} is not a legacy Megatron-LM checkpoint (mp_rank_*/{LEGACY_FILE})")
    return LegacyCheckpoint(loc.ckpt_dir)


def hf_to_mcore(a: argparse.Namespace) -> int:
    """Each rank reads its HF slices into its shard; save_torch_dist writes them."""
    _check_digests(a.hf, quiet=True)
    _check_layout(a.hf, a.tp, a.pp, a.vpp)
    _check_experts(a.hf, a.ep)
    rc = relaunch_if_needed(a.tp * a.pp * a.ep, a.argv)
    if rc is not None:
        return rc
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, fill_from_reader
    from megatron_rl.weights.ckpt_write import save_torch_dist
    from megatron_rl.weights.hf_io import HFReader, copy_side_files

    with _parallel(a.tp, a.pp, ep=a.ep) as ps:
        args = load_model_args(a.hf)
        dtype = _dtype(a.dtype) if a.dtype else _config_dtype(args)
        model = build_model(args, ps, dtype=dtype, sdpa=False, options=_chunks(a))
        fill_from_reader(model, ps, HFReader(a.hf), progress=ps.rank == 0)
        save_torch_dist(model, ps, a.out, extra={"source": os.path.abspath(a.hf)})
        if ps.rank == 0:
            copied = copy_side_files([a.hf], a.out)
            _say(
                ps,
                f"wrote torch_dist checkpoint {shown_out(a)} (TP={a.tp} PP={a.pp}, {dtype}); copied {copied}",
            )
    return 0


def mcore_to_hf(a: argparse.Namespace) -> int:
    """Stream HF tensors out of a torch_dist or legacy checkpoint into safetensors files."""
    require_single_process("mcore-to-hf")
    _check_digests(a.ckpt)
    from ckpt_tools.hf_writer import parse_size, write_hf
    from megatron_rl.models.loading import detect_format, load_model_args_any, open_reader
    from megatron_rl.weights.hf_io import copy_side_files

    fmt = detect_format(a.ckpt)
    if fmt == "hf":
        raise SystemExit(f"{a.ckpt} is already an HF model directory")
    with _parallel(1, 1, needed=fmt == "torch_dist"):  # dist_checkpointing needs a world
        args = load_model_args_any(a.ckpt)
        reader = open_reader(a.ckpt, args)
        # default: the embedding's dtype, i.e. the model's parameter dtype
        dtype = _dtype(a.dtype) if a.dtype else reader.get(reader.keys()[0]).dtype
        files = write_hf(reader, args, a.out, parse_size(a.max_shard_size), progress=True, dtype=dtype)
        copied = copy_side_files(_side_dirs(a.ckpt), a.out)
        print(f"wrote HF model {shown_out(a)} from {fmt} checkpoint: {files}; copied {copied}", flush=True)
    return 0


class _Merged:
    """An HF tensor source with LoRA adapters merged in: W + ``deltas[name]`` for every adapted weight
    (models.lora.hf_deltas)."""

    def __init__(self, reader, deltas: dict) -> None:
        self.reader, self.deltas = reader, deltas

    def keys(self) -> list[str]:
        return self.reader.keys()

    def get(self, name: str):
        w = self.reader.get(name)
        delta = self.deltas.get(name)
        return w if delta is None else (w.float() + delta).to(w.dtype)

    def read(self, piece, dim: int | None):
        t = self.get(piece.hf_name)
        return t[:, piece.start : piece.stop] if dim == 1 else t[piece.start : piece.stop]


def export_peft(a: argparse.Namespace) -> int:
    """A LoRA checkpoint's adapters -> a PEFT adapter directory (``PeftModel.from_pretrained`` on the
    base loads it); with --merged, the base model with the adapters merged, as an HF directory."""
    require_single_process("export-peft")
    _check_digests(a.ckpt)
    from safetensors.torch import save_file

    from ckpt_tools.hf_writer import parse_size, write_hf
    from megatron_rl.models.loading import load_model_args_any, open_reader
    from megatron_rl.models.lora_files import hf_deltas, peft_config, peft_tensors, read_adapters
    from megatron_rl.weights.hf_io import copy_side_files

    with _parallel(1, 1):  # dist_checkpointing needs a world
        spec, adapters, experts = read_adapters(a.ckpt)
        args = load_model_args_any(a.ckpt)
        base = a.base or spec.base
        if a.merged:
            reader = open_reader(base, args)
            dtype = reader.get(reader.keys()[0]).dtype
            merged = _Merged(reader, hf_deltas(args, spec, adapters, experts))
            files = write_hf(merged, args, a.out, parse_size(a.max_shard_size), dtype=dtype)
            copied = copy_side_files([base, *_side_dirs(a.ckpt)], a.out)
            print(f"wrote HF model {shown_out(a)}: {base} + {a.ckpt}'s adapters: {files}; copied {copied}")
            return 0
        if experts:
            raise ValueError(
                f"{a.ckpt} holds adapters on routed experts, which have no PEFT layout here: export the "
                "merged model with --merged"
            )
        tensors = peft_tensors(args, adapters)
    os.makedirs(a.out, exist_ok=True)
    save_file(tensors, os.path.join(a.out, "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({k.split(".")[-3] for k in tensors})
    with open(os.path.join(a.out, "adapter_config.json"), "w") as f:
        json.dump(peft_config(spec, targets, base), f, indent=2)
    print(f"wrote PEFT adapters {shown_out(a)} (rank {spec.rank}, {len(tensors) // 2} modules) of {base}")
    return 0


def legacy_to_dist(a: argparse.Namespace) -> int:
    """Each rank fills its shard from the merged legacy shards; save_torch_dist writes them."""
    _check_digests(a.legacy)
    tp, pp = a.tp, a.pp
    if tp is None or pp is None:  # default: the legacy checkpoint's own layout (from its directory names)
        saved = _legacy(a.legacy)
        tp, pp = tp or saved.tp, pp or saved.pp
    _check_layout(a.legacy, tp, pp)
    rc = relaunch_if_needed(tp * pp, [*a.argv, "--tp", str(tp), "--pp", str(pp)])
    if rc is not None:
        return rc
    from megatron_rl.models.builder import build_model, fill_from_reader
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.weights.ckpt_write import save_torch_dist
    from megatron_rl.weights.hf_io import copy_side_files
    from megatron_rl.weights.legacy import LegacyReader

    ckpt = _legacy(a.legacy)
    with _parallel(tp, pp) as ps:
        args = load_model_args_any(a.legacy)
        dtype = next(iter(ckpt.model(0, 0).values())).dtype
        model = build_model(args, ps, dtype=dtype, sdpa=False)
        fill_from_reader(model, ps, LegacyReader(ckpt, args), progress=ps.rank == 0)
        save_torch_dist(model, ps, a.out, extra={"source": os.path.abspath(a.legacy)})
        if ps.rank == 0:
            copied = copy_side_files(_side_dirs(a.legacy), a.out)
            _say(
                ps,
                f"wrote torch_dist checkpoint {shown_out(a)} (TP={tp} PP={pp}) from legacy TP={ckpt.tp} "
                f"PP={ckpt.pp}; copied {copied}",
            )
    return 0


def reshard(a: argparse.Namespace) -> int:
    """Load a torch_dist checkpoint at the target TP/PP (actor or critic) and save it again."""
    _check_digests(a.ckpt)
    _check_layout(a.ckpt, a.tp, a.pp, a.vpp)
    rc = relaunch_if_needed(a.tp * a.pp, a.argv)
    if rc is not None:
        return rc
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.loading import load_model_args_any
    from megatron_rl.weights.ckpt_format import locate_megatron_checkpoint, read_our_metadata
    from megatron_rl.weights.ckpt_write import save_torch_dist
    from megatron_rl.weights.hf_io import copy_side_files
    from megatron_rl.weights.safe_load import check_torch_dist
    from megatron_rl.weights.torch_dist import load_torch_dist

    with _parallel(a.tp, a.pp) as ps:
        loc = locate_megatron_checkpoint(a.ckpt)
        if loc is None or loc.format != "torch_dist":
            raise SystemExit(f"{a.ckpt} is not a torch_dist checkpoint")
        args = load_model_args_any(a.ckpt)
        ours = read_our_metadata(loc) or {}
        meta, _ = check_torch_dist(loc.ckpt_dir)
        saved = meta.state_dict_metadata["embedding.word_embeddings.weight"].properties.dtype
        dtype = _dtype(ours["dtype"]) if ours.get("dtype") in ("float32", "bfloat16", "float16") else saved
        role = ours.get("role", "actor")
        model = build_model(args, ps, role=role, dtype=dtype, sdpa=False, options=_chunks(a))
        load_torch_dist(model, ps, a.ckpt)
        save_torch_dist(model, ps, a.out, extra={"source": os.path.abspath(a.ckpt)})
        if ps.rank == 0:
            copy_side_files(_side_dirs(a.ckpt), a.out)
            _say(ps, f"wrote torch_dist checkpoint {shown_out(a)} at TP={a.tp} PP={a.pp}")
    return 0


def mcore_to_legacy(a: argparse.Namespace) -> int:
    """Any format -> Megatron-LM mp_rank files at the target TP/PP, one file at a time; the model's HF
    config.json and tokenizer files go beside them, so that the checkpoint converts back with its
    special-token ids and chat template."""
    require_single_process("mcore-to-legacy")
    _check_digests(a.ckpt)
    _check_layout(a.ckpt, a.tp, a.pp)
    from megatron_rl.models.loading import detect_format, load_model_args_any, open_reader
    from megatron_rl.weights.ckpt_write import save_legacy
    from megatron_rl.weights.hf_io import copy_side_files

    fmt = detect_format(a.ckpt)
    with _parallel(1, 1, needed=fmt == "torch_dist"):
        args = load_model_args_any(a.ckpt)
        reader = open_reader(a.ckpt, args)
        dtype = reader.get(reader.keys()[0]).dtype
        save_legacy(reader, args, a.out, a.tp, a.pp, iteration=a.iteration, dtype=dtype, progress=True)
        with open(os.path.join(a.out, "config.json"), "w") as f:
            json.dump(args.hf_config, f, indent=2)
        copied = copy_side_files(_side_dirs(a.ckpt), a.out)
        print(
            f"wrote legacy Megatron-LM checkpoint {shown_out(a)} (TP={a.tp} PP={a.pp}) from {fmt}; "
            f"config.json and {copied} beside it",
            flush=True,
        )
    return 0


def verify(a: argparse.Namespace) -> int:
    """Max |logit difference| between the checkpoint (any format, at --tp/--pp/--ep) and the HF model."""
    _check_digests(a.ckpt)
    _check_digests(a.hf, quiet=True)
    _check_layout(a.ckpt, a.tp, a.pp, a.vpp)
    _check_experts(a.ckpt, a.ep)
    rc = relaunch_if_needed(a.tp * a.pp * a.ep, a.argv)
    if rc is not None:
        return rc
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatron_rl.models.builder import build_model
    from megatron_rl.models.forward import gather_tp, run_pipeline
    from megatron_rl.models.loading import load_model_args_any, load_weights

    with _parallel(a.tp, a.pp, ep=a.ep) as ps:
        with open(os.path.join(a.hf, "config.json")) as f:
            hf_vocab = json.load(f)["vocab_size"]
        args = load_model_args_any(a.ckpt)
        model = build_model(args, ps, dtype=torch.float32, options=_chunks(a))
        fmt = load_weights(model, a.ckpt, ps)
        model.eval()
        vocab = min(args.vocab_size, hf_vocab)  # Megatron-LM pads its vocabulary; compare real tokens
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, vocab, (a.batch, a.seq_len), generator=g)
        mb = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            outs = run_pipeline(model, ps, [mb], lambda m, out: gather_tp(out, ps)[..., :vocab], True)
        result = torch.zeros(2, dtype=torch.float64)  # [max |diff|, max |HF logit|]
        if ps.is_last_stage and ps.tp_rank == 0 and ps.dp_rank == 0:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(
                a.hf, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            with torch.no_grad():
                ref = hf(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[..., :vocab]
            diff = (ref - outs[0]).abs().max()
            result[0] = diff if torch.isfinite(diff) else float("inf")
            result[1] = ref.abs().max()
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        diff, top = result.tolist()
        ok = diff <= a.tol
        _say(
            ps,
            f"verify {a.ckpt} ({fmt}, TP={a.tp} PP={a.pp} VPP={a.vpp} EP={a.ep}) vs {a.hf}: max |logit "
            f"diff| = {diff:.3e} over {a.batch}x{a.seq_len} tokens, {vocab} logits (max |logit| {top:.2f}); "
            f"tol {a.tol:g}: " + ("OK" if ok else "FAILED"),
        )
    return 0 if ok else 1
