"""The CPU tool-calling demo: "look up the secret", a task no policy solves without its tool.

    python -m megatron_rl.demo tools --out .demo/tools
    torchrun --nproc_per_node=2 -m megatron_rl.train --config yaml/cpu_demo_tools.yaml

Every prompt is the same two tokens, ``secret =``; each row's answer is a random digit that only the
``lookup`` tool returns (megatron_rl.rollout.agent.tools.LookupTool, fed from the row's
``extra_info.tools_kwargs.lookup.create_kwargs.value``). Without the tool the best policy scores 1/10.
An episode that solves it has two model turns::

    secret = | <tool_call>{"name": "lookup", ...}</tool_call> | <tool_response> 7 </tool_response> = | 7 </s>
    prompt   | model (1 token, a stop token)                  | tool reply (4 tokens, mask 0)        | model

The vocabulary is 19 words so that a random policy finds the call (one token, chance 1/19): the Hermes
call ``<tool_call>{"name": "lookup", "arguments": {}}</tool_call>`` is a single token of the tokenizer
and decodes to that text, which the agent loop parses like any model's; ``<tool_response>`` and
``</tool_response>`` are single tokens too. The reward (:func:`compute_score`) is 1 when the first word of
the last model turn is the secret; ``multi_turn.tool_reward_weight`` adds the tool's calc_reward (1 once
called) times the weight, a small push towards calling while the copy from the reply is learned.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rl.demo.toy import SPECIAL_TOKENS, TOY_DIGITS, word_tokenizer

TOOLS_DATA_SOURCE = "toy/tool_lookup"
TOOL_NAME = "lookup"
CALL_TOKEN = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
REPLY_OPEN, REPLY_CLOSE = "<tool_response>", "</tool_response>"
TOOL_TOKENS = (CALL_TOKEN, REPLY_OPEN, REPLY_CLOSE)
WORDS = ("secret", "=")

# Tool messages are wrapped in the reply tokens; every other message is its content; the generation
# prompt is "=".
TOOLS_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    + REPLY_OPEN
    + " {{ m['content'] }} "
    + REPLY_CLOSE
    + " {% else %}{{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}= {% endif %}"
)

TOOL_CONFIG = {
    "tools": [
        {
            "class_name": "megatron_rl.rollout.agent.tools.LookupTool",
            "config": {"type": "native", "reward": 1.0},
            "tool_schema": {
                "type": "function",
                "function": {
                    "name": TOOL_NAME,
                    "description": "Look up this question's secret digit.",
                    "parameters": {"type": "object", "properties": {}, "required": []},
                },
            },
        }
    ]
}


def tools_vocab() -> dict[str, int]:
    tokens = [*SPECIAL_TOKENS, *TOY_DIGITS, *WORDS, *TOOL_TOKENS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tools_tokenizer(save_dir: str | os.PathLike[str] | None = None):
    """The 19-word tokenizer of the task; the tool tokens are added tokens (matched whole by encode,
    kept by decode)."""
    return word_tokenizer(tools_vocab(), TOOLS_CHAT_TEMPLATE, added=tuple(TOOL_TOKENS), save_dir=save_dir)


def make_row(secret: int, idx: int, split: str) -> dict[str, Any]:
    return {
        "data_source": TOOLS_DATA_SOURCE,
        "prompt": [{"role": "user", "content": "secret"}],
        "ability": "tool",
        "reward_model": {"style": "rule", "ground_truth": str(secret)},
        "extra_info": {
            "split": split,
            "index": idx,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"value": str(secret)}}},
        },
    }


def make_dataset(out_dir: str | os.PathLike[str], n_train: int, n_test: int, seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        rows = [make_row(rng.randrange(10), i, split) for i in range(n)]
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(str(path))
    return paths[0], paths[1]


def final_answer(solution_str: str) -> str | None:
    """The first word of the last model turn: after the last tool reply and its "=" prompt."""
    words = solution_str.split(REPLY_CLOSE)[-1].split()
    if words and words[0] == "=":
        words = words[1:]
    return words[0] if words else None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> dict[str, float]:
    """{"score", "acc"}: 1.0 when the final answer is the secret (the tool's reward is added by
    multi_turn.tool_reward_weight, not here)."""
    acc = float(final_answer(solution_str) == str(ground_truth).strip())
    return {"score": acc, "acc": acc}


# The weights' init std. At HF's default, 0.02, the reply's digit hardly reaches the answer's logits
# (the answer distribution differs by 0.013 in total variation between secrets, at 0.05 by 0.05):
# the copy is learned only once the attention and MLP weights have grown, a plateau whose length
# depended on the sampling seed (validation at step 60: 0.83 / 1.0 / 0.40 at rollout.seed 0 / 1 / 2).
# At 0.05 the same recipe scores 1.0 / 1.0 / 1.0 / 0.92 at seeds 0-3; the call token starts at
# probability 0.028 after the prompt (0.043 at 0.02), still found within 10 steps.
INITIALIZER_RANGE = 0.05


def _model_is_current(model_dir: str) -> bool:
    """An earlier build's model (weights present, same init std) is kept; an older one is rebuilt."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return (
        os.path.isfile(os.path.join(model_dir, "model.safetensors"))
        and cfg.get("initializer_range") == INITIALIZER_RANGE
    )


def prepare(out: str, seed: int = 0) -> dict[str, str]:
    """Model (random, 2 layers, hidden 64, init std :data:`INITIALIZER_RANGE`), tokenizer, tool config and
    data under ``out``."""
    from megatron_rl.models.random_hf import save_random_hf_model

    model_dir, data_dir = os.path.join(out, "model"), os.path.join(out, "data")
    tok = build_tools_tokenizer(model_dir)
    call_id = tok.convert_tokens_to_ids(CALL_TOKEN)
    if not _model_is_current(model_dir):
        save_random_hf_model(
            model_dir,
            "llama",
            seed=seed,
            init="hf",
            initializer_range=INITIALIZER_RANGE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=len(tok),
            max_position_embeddings=64,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
        )
    # a model turn ends at EOS or right after the tool call (as a chat model ends its turn)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.eos_token_id, call_id], "pad_token_id": tok.pad_token_id}, f)
    tool_config = os.path.join(out, "tool_config.yaml")
    import yaml

    with open(tool_config, "w") as f:
        yaml.safe_dump(TOOL_CONFIG, f, sort_keys=False)
    train, test = make_dataset(data_dir, n_train=4096, n_test=256, seed=seed)
    return {"model": model_dir, "train": train, "test": test, "tool_config": tool_config}


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_rl.demo tools",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default=".demo/tools")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random model and the secrets")
    a = ap.parse_args()
    print(" ".join(f"{k}={v}" for k, v in prepare(a.out, seed=a.seed).items()))
