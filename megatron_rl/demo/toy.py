"""The CPU demo's task, built entirely in code: "copy the last digit".

Everything the demo needs is generated here, so it runs without a model hub or a downloaded dataset:

    build_toy_tokenizer()  -> a 16-token word-level tokenizer with a chat template
    make_toy_dataset(dir)  -> train.parquet / test.parquet in verl's row format (see megatron_rl.data)
    toy_compute_score(...) -> the rule reward, reached through reward.default_compute_score
                              via data_source == TOY_DATA_SOURCE

Task: the user message is ``copy d1 d2 ... dn`` (n random digits, n in [TOY_MIN_DIGITS, TOY_MAX_DIGITS]);
the chat template renders it as ``copy d1 ... dn = `` and the reward is 1.0 when the first response token
is ``dn``, else 0.0.

Why this task: the answer depends on the prompt (a policy that ignores the prompt scores exactly 1/10), yet
the dependency is a fixed relative offset (the token just before ``=``), which one attention head of a
2-layer, 64-wide transformer can learn from a dense, single-token reward in tens of PPO steps. The
generation prompt ends in "=", so a randomly initialised model's bias to echo the last token scores 0
and cannot inflate the starting reward. A uniformly random digit scores exactly 1/10;
a uniformly random token over the whole 16-token vocabulary scores 1/16, so a rise to >= 0.9 cannot come
from a prompt-independent answer.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TOY_DATA_SOURCE = "toy/copy_last_digit"
TOY_ABILITY = "copy"
TOY_MIN_DIGITS = 3
TOY_MAX_DIGITS = 5
TOY_DIGITS: tuple[str, ...] = tuple(str(d) for d in range(10))

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
TOY_WORDS: tuple[str, ...] = ("copy", "=")

# Roles are ignored: the task has a single user turn, and a template that emits only content keeps every
# prompt a clean sequence of vocabulary words (no <unk> from role names or markup).
TOY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}= {% endif %}"
)


def toy_vocab() -> dict[str, int]:
    """Token -> id; specials first so that <pad> is id 0."""
    tokens = [*SPECIAL_TOKENS, *TOY_DIGITS, *TOY_WORDS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_toy_tokenizer(save_dir: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerFast:
    """Build the toy word-level tokenizer; optionally ``save_pretrained`` it to ``save_dir``.

    The saved directory loads back with ``transformers.AutoTokenizer.from_pretrained(save_dir)``,
    chat template included.
    """
    return word_tokenizer(toy_vocab(), TOY_CHAT_TEMPLATE, save_dir=save_dir)


def word_tokenizer(
    vocab: dict[str, int],
    chat_template: str,
    added: tuple[str, ...] = (),
    save_dir: str | os.PathLike[str] | None = None,
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``vocab`` (the toy's special tokens included); ``added`` words are
    added tokens (matched whole by encode, kept by decode)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Digits are split individually so "371" and "3 7 1" tokenize alike; punctuation such as "="
    # becomes its own word even without surrounding spaces.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    # Words are rejoined with single spaces so decoded responses split back into tokens with str.split().
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    if added:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=512,
        padding_side="left",
    )
    tokenizer.chat_template = chat_template
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def make_toy_row(digits: list[int], idx: int, split: str) -> dict[str, Any]:
    """One verl-format row for the digit sequence ``digits``."""
    content = "copy " + " ".join(str(d) for d in digits)
    return {
        "data_source": TOY_DATA_SOURCE,
        "prompt": [{"role": "user", "content": content}],
        "ability": TOY_ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(digits[-1])},
        "extra_info": {"split": split, "index": idx},
    }


def make_toy_dataset(
    out_dir: str | os.PathLike[str], n_train: int, n_test: int, seed: int
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; return their paths.

    Deterministic in ``seed``; train and test draw from one generator so they are different samples.
    """
    if n_train < 1 or n_test < 1:
        raise ValueError(f"make_toy_dataset needs n_train >= 1 and n_test >= 1, got {n_train}, {n_test}")
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for idx in range(n):
            length = rng.randint(TOY_MIN_DIGITS, TOY_MAX_DIGITS)
            rows.append(make_toy_row([rng.randrange(10) for _ in range(length)], idx, split))
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(str(path))
    return paths[0], paths[1]


def toy_compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the first word of the decoded response is the expected digit, else 0.0.

    The toy tokenizer decodes tokens joined by single spaces, so the first whitespace-separated word is
    the first response token. Trailing tokens are ignored: the task is the single-token answer.
    """
    words = solution_str.split()
    if not words:
        return 0.0
    return 1.0 if words[0] == str(ground_truth).strip() else 0.0
