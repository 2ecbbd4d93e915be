"""GSM8K -> verl-format train.parquet / test.parquet for megatron-rl.

    python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k [--local_dataset_path DIR]

Source, first that applies:
  --local_dataset_path DIR   a local copy: parquet or jsonl files with the GSM8K columns question/answer
                             (file names containing "train" / "test", as in the hub repo's main/ folder or
                             openai/grade-school-math's train.jsonl / test.jsonl), or a directory written
                             by datasets' save_to_disk (needs the `datasets` package)
  otherwise                  datasets.load_dataset("openai/gsm8k", "main") from the Hugging Face hub

Each GSM8K example {question, answer} becomes one row (see make_row): the question plus an instruction to
end with "#### <answer>" as a single user message, data_source "openai/gsm8k" (scored by
megatron_rl.reward.compute_score_gsm8k), and the number after "####" in the reference answer, without
thousands separators, as the ground truth.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def extract_ground_truth(answer: str) -> str:
    """The final answer of a GSM8K reference solution: the number right after the first "#### "
    (an optional "-", then digits, "." and ","), with "," removed ("#### 5 dollars" -> "5")."""
    match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' final answer: {answer[-200:]!r}")
    return match.group(1).replace(",", "")


def make_row(example: dict[str, Any], idx: int, split: str) -> dict[str, Any]:
    """One verl-format row from a GSM8K example {"question": str, "answer": str}."""
    question = example["question"]
    answer = example["answer"]
    try:
        ground_truth = extract_ground_truth(answer)
    except ValueError as exc:
        raise ValueError(f"{split} example {idx}: {exc}") from None
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": idx, "answer": answer, "question": question},
    }


def _find_split_file(root: Path, split: str) -> Path | None:
    candidates = sorted(
        p for p in root.rglob("*") if p.is_file() and p.suffix in (".parquet", ".jsonl") and split in p.name
    )
    # The hub repo also ships a "socratic" config whose answers have a different style; prefer "main".
    main = [p for p in candidates if "socratic" not in str(p.relative_to(root))]
    candidates = main or candidates
    if len(candidates) > 1:
        raise ValueError(
            f"--local_dataset_path {root}: several {split} files {[str(p) for p in candidates]}; "
            "point it at the folder that holds exactly one"
        )
    return candidates[0] if candidates else None


def _read_examples(path: Path) -> list[dict[str, Any]]:
    table = pq.read_table(path) if path.suffix == ".parquet" else pa_json.read_json(path)
    missing = {"question", "answer"} - set(table.column_names)
    if missing:
        raise ValueError(f"{path}: missing GSM8K columns {sorted(missing)} (found {table.column_names})")
    return table.select(["question", "answer"]).to_pylist()


def load_local(path: str) -> dict[str, list[dict[str, Any]]]:
    """{"train": [...], "test": [...]} GSM8K examples from a local copy."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--local_dataset_path {path!r} is not a directory")
    if (root / "dataset_dict.json").is_file():
        try:
            import datasets
        except ImportError as exc:
            raise ImportError(
                f"{root} was written by datasets' save_to_disk; install `datasets` to read it, "
                "or pass a folder of parquet/jsonl files"
            ) from exc
        ds = datasets.load_from_disk(str(root))
        return {split: [dict(ex) for ex in ds[split]] for split in SPLITS}
    splits = {}
    for split in SPLITS:
        file = _find_split_file(root, split)
        if file is None:
            raise FileNotFoundError(
                f"--local_dataset_path {root}: no parquet/jsonl file with {split!r} in its name"
            )
        splits[split] = _read_examples(file)
    return splits


def load_from_hub() -> dict[str, list[dict[str, Any]]]:
    try:
        import datasets
    except ImportError as exc:
        raise SystemExit(
            "the `datasets` package is not installed, so GSM8K cannot be downloaded; "
            "pass --local_dataset_path DIR with train/test parquet or jsonl files of GSM8K"
        ) from exc
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as exc:
        raise SystemExit(
            f"downloading openai/gsm8k failed ({exc!r}); pass --local_dataset_path DIR with train/test "
            "parquet or jsonl files of GSM8K"
        ) from exc
    return {split: [dict(ex) for ex in ds[split]] for split in SPLITS}


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local_dir", default="~/data/gsm8k", help="output folder for train/test.parquet")
    parser.add_argument("--local_dataset_path", default=None, help="local copy of GSM8K (see above)")
    args = parser.parse_args(argv)

    examples = load_local(args.local_dataset_path) if args.local_dataset_path else load_from_hub()
    return write_splits(examples, args.local_dir, make_row)


def write_splits(examples: dict, local_dir: str, row_of) -> dict[str, str]:
    """``row_of(example, index, split)`` for every example -> ``local_dir/{split}.parquet``; returns
    {split: path}."""
    out_dir = Path(os.path.expanduser(local_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in SPLITS:
        rows = [row_of(ex, idx, split) for idx, ex in enumerate(examples[split])]
        path = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        written[split] = str(path)
        print(f"wrote {len(rows)} {split} rows to {path}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
