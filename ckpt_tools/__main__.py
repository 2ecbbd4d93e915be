"""``python -m ckpt_tools <verb> ...``: the command line (argument parsing only; verbs.py does the work)."""

from __future__ import annotations

import argparse
import sys

VERBS = {
    "hf-to-mcore": (
        "HF model directory -> megatron-core torch_dist checkpoint at a chosen TP/PP",
        "python -m ckpt_tools hf-to-mcore --hf Qwen2.5-1.5B --out ckpt/qwen-tp2 --tp 2 --pp 1",
    ),
    "mcore-to-hf": (
        "torch_dist or legacy Megatron-LM checkpoint -> HF directory (config.json + safetensors)",
        "python -m ckpt_tools mcore-to-hf --ckpt ckpt/qwen-tp2 --out qwen-hf",
    ),
    "legacy-to-dist": (
        "legacy Megatron-LM checkpoint (mp_rank_*/model_optim_rng.pt) -> torch_dist",
        "python -m ckpt_tools legacy-to-dist --legacy megatron-lm/checkpoints --out ckpt/qwen-dist",
    ),
    "reshard": (
        "torch_dist checkpoint -> torch_dist checkpoint at another TP/PP",
        "python -m ckpt_tools reshard --ckpt ckpt/qwen-tp2 --out ckpt/qwen-pp2 --tp 1 --pp 2",
    ),
    "mcore-to-legacy": (
        "HF, torch_dist or legacy -> legacy Megatron-LM checkpoint at a chosen TP/PP",
        "python -m ckpt_tools mcore-to-legacy --ckpt ckpt/qwen-tp2 --out megatron-lm/ckpt --tp 2 --pp 2",
    ),
    "export-peft": (
        "LoRA checkpoint (a trainer checkpoint's actor/) -> PEFT adapter directory, or --merged HF model",
        "python -m ckpt_tools export-peft --ckpt ckpts/global_step_50/actor --out qwen-lora-peft",
    ),
    "verify": (
        "HF vs Megatron logits on the same tokens; exit 1 above --tol",
        "python -m ckpt_tools verify --hf Qwen2.5-1.5B --ckpt ckpt/qwen-tp2 --tp 2",
    ),
}

DIST_NOTE = (
    "Runs as TP x PP gloo processes on the CPU: under torchrun it uses torchrun's processes, otherwise "
    "it re-launches itself under torchrun with that many."
)


def _expert_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size of a mixture-of-experts model (default 1; TP x PP x EP processes)",
    )


def _layout(p: argparse.ArgumentParser, default: int | None = 1) -> None:
    what = default if default is not None else "the input checkpoint's"
    p.add_argument("--tp", type=int, default=default, help=f"tensor-parallel size (default {what})")
    p.add_argument("--pp", type=int, default=default, help=f"pipeline-parallel size (default {what})")


def _virtual(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="model chunks per pipeline stage (interleaved pipelines; default 1): torch_dist files are "
        "the same at any layout, this builds and checks the model at it",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ckpt_tools",
        description="Convert, reshard and verify checkpoints between HF, megatron-core torch_dist and "
        "legacy Megatron-LM formats.",
        epilog="examples:\n" + "\n".join(f"  {ex}" for _, ex in VERBS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name: str, dist: bool) -> argparse.ArgumentParser:
        help_, example = VERBS[name]
        p = sub.add_parser(
            name,
            help=help_,
            description=help_ + (". " + DIST_NOTE if dist else "."),
            epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if name != "verify":
            p.add_argument(
                "--overwrite",
                action="store_true",
                help="replace a non-empty --out as a whole (refused without it); the old contents go "
                "only once the new output is complete",
            )
        return p

    p = verb("hf-to-mcore", True)
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output torch_dist checkpoint directory")
    _layout(p)
    _virtual(p)
    _expert_layout(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the config's dtype")

    p = verb("mcore-to-hf", False)
    p.add_argument("--ckpt", required=True, help="torch_dist or legacy checkpoint directory")
    p.add_argument("--out", required=True, help="output HF model directory")
    p.add_argument(
        "--max-shard-size", default="1GB", help="safetensors file size (default 1GB); bounds memory"
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: the dtype of the embedding"
    )

    p = verb("legacy-to-dist", True)
    p.add_argument(
        "--legacy",
        required=True,
        help="Megatron-LM save dir (with latest_checkpointed_iteration.txt) or iter_XXXXXXX dir",
    )
    p.add_argument("--out", required=True, help="output torch_dist checkpoint directory")
    _layout(p, default=None)

    p = verb("reshard", True)
    p.add_argument("--ckpt", required=True, help="torch_dist checkpoint directory")
    p.add_argument("--out", required=True, help="output torch_dist checkpoint directory")
    _layout(p)
    _virtual(p)

    p = verb("mcore-to-legacy", False)
    p.add_argument("--ckpt", required=True, help="HF, torch_dist or legacy checkpoint directory")
    p.add_argument("--out", required=True, help="output Megatron-LM save directory")
    _layout(p)
    p.add_argument("--iteration", type=int, default=1, help="iteration number written (default 1)")

    p = verb("export-peft", False)
    p.add_argument("--ckpt", required=True, help="torch_dist checkpoint of a model trained with LoRA")
    p.add_argument("--out", required=True, help="output directory (PEFT adapters; --merged: HF model)")
    p.add_argument("--merged", action="store_true", help="write the base model with the adapters merged")
    p.add_argument("--base", help="the base model's directory (default: the path the checkpoint records)")
    p.add_argument("--max-shard-size", default="1GB", help="--merged: safetensors file size (default 1GB)")

    p = verb("verify", True)
    p.add_argument("--hf", required=True, help="reference HF model directory")
    p.add_argument("--ckpt", required=True, help="checkpoint to check: HF, torch_dist or legacy")
    _layout(p)
    _virtual(p)
    _expert_layout(p)
    p.add_argument(
        "--tol", type=float, default=5e-3, help="max allowed |logit difference| (default 5e-3, float32)"
    )
    p.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    a.argv = argv
    from ckpt_tools import verbs
    from ckpt_tools.launch import report
    from ckpt_tools.staging import run_with_staging
    from megatron_rl.config import ConfigError, DataError
    from megatron_rl.errors import LaunchError

    verb = getattr(verbs, a.verb.replace("-", "_"))
    try:
        return report(run_with_staging(a, verb) if hasattr(a, "out") else verb(a))
    except (LaunchError, ConfigError, DataError, FileNotFoundError) as e:
        # a model or checkpoint refused, a path that is not there: one line, as the trainer says it
        print(f"ckpt_tools: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
