"""GSM8K with a calculator tool -> verl-format train.parquet / test.parquet for multi-turn rollouts.

    python examples/data_preprocess/gsm8k_multiturn.py --local_dir ~/data/gsm8k_tools \
        [--local_dataset_path DIR]

The rows of gsm8k.py (same sources, same ground truth, data_source "openai/gsm8k") with a system prompt
that offers the ``calc`` tool of examples/tool_config/gsm8k_calculator.yaml, and, in extra_info,
``tools_kwargs`` (per tool: create_kwargs, handed to the tool's create) and ``interaction_kwargs`` (the
simulated user of examples/tool_config/gsm8k_interaction.yaml, when one is configured). The chat
template also lists the tool's schema (the trainer passes the tool config's schemas to it).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gsm8k import load_from_hub, load_local, write_splits  # noqa: E402
from gsm8k import make_row as single_turn_row  # noqa: E402

SYSTEM = (
    "You are a math expert. Solve the problem step by step. You can call the `calc` tool to evaluate "
    'arithmetic; call it as many times as you need. Put the final answer after "####".'
)


def make_row(example: dict[str, Any], idx: int, split: str) -> dict[str, Any]:
    row = single_turn_row(example, idx, split)
    row["prompt"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["question"]}]
    truth = row["reward_model"]["ground_truth"]
    row["extra_info"]["tools_kwargs"] = {"calc": {"create_kwargs": {"ground_truth": truth}}}
    row["extra_info"]["interaction_kwargs"] = {"name": "gsm8k", "ground_truth": truth}
    return row


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--local_dir", default="~/data/gsm8k_tools", help="output folder for train/test.parquet"
    )
    parser.add_argument("--local_dataset_path", default=None, help="local copy of GSM8K (see gsm8k.py)")
    args = parser.parse_args(argv)
    examples = load_local(args.local_dataset_path) if args.local_dataset_path else load_from_hub()
    return write_splits(examples, args.local_dir, make_row)


if __name__ == "__main__":
    main()
