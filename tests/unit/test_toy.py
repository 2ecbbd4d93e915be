"""The CPU demo's task: tokenizer, dataset rows, reward and its chance level."""

from __future__ import annotations

from fractions import Fraction

import pyarrow.parquet as pq
import pytest

from megatron_rl.data import PromptDataset
from megatron_rl.demo.toy import (
    TOY_DATA_SOURCE,
    TOY_DIGITS,
    TOY_MAX_DIGITS,
    TOY_MIN_DIGITS,
    build_toy_tokenizer,
    make_toy_dataset,
    toy_compute_score,
)
from megatron_rl.reward.rules import RewardManager, default_compute_score


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory):
    return make_toy_dataset(tmp_path_factory.mktemp("toy"), n_train=200, n_test=50, seed=0)


def test_tokenizer_vocab_and_specials(tok):
    assert len(tok) < 64
    assert tok.pad_token == "<pad>" and tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    for d in TOY_DIGITS:
        assert tok.convert_tokens_to_ids(d) != tok.unk_token_id


def test_tokenizer_round_trip_and_chat_template(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "copy 3 7 1"}], add_generation_prompt=True, tokenize=False
    )
    assert text.strip() == "copy 3 7 1 ="
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["copy", "3", "7", "1", "="]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == "copy 3 7 1 ="
    with_eos = [*ids[-2:], tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(with_eos, skip_special_tokens=True) == "1 ="


def test_tokenizer_save_and_load(tmp_path, tok):
    from transformers import AutoTokenizer

    build_toy_tokenizer(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.eos_token_id == tok.eos_token_id and loaded.pad_token_id == tok.pad_token_id
    messages = [{"role": "user", "content": "copy 4 2"}]
    assert loaded.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_dataset_rows_valid(toy_files, tok):
    train_path, test_path = toy_files
    train = pq.read_table(train_path).to_pylist()
    test = pq.read_table(test_path).to_pylist()
    assert len(train) == 200 and len(test) == 50
    for split, rows in (("train", train), ("test", test)):
        for idx, row in enumerate(rows):
            assert row["data_source"] == TOY_DATA_SOURCE
            assert row["reward_model"]["style"] == "rule"
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == idx
            (message,) = row["prompt"]
            assert message["role"] == "user"
            words = message["content"].split()
            assert words[0] == "copy" and TOY_MIN_DIGITS <= len(words) - 1 <= TOY_MAX_DIGITS
            assert all(w in TOY_DIGITS for w in words[1:])
            assert row["reward_model"]["ground_truth"] == words[-1]
    # Every digit appears as an answer, so no constant answer can do well.
    assert {r["reward_model"]["ground_truth"] for r in train} == set(TOY_DIGITS)

    ds = PromptDataset(train_path, tok, max_prompt_length=TOY_MAX_DIGITS + 2)
    assert len(ds) == 200 and ds.num_filtered == 0
    assert all(tok.unk_token_id not in ds[i].prompt_ids for i in range(len(ds)))


def test_dataset_deterministic(tmp_path):
    a = make_toy_dataset(tmp_path / "a", 20, 5, seed=1)
    b = make_toy_dataset(tmp_path / "b", 20, 5, seed=1)
    c = make_toy_dataset(tmp_path / "c", 20, 5, seed=2)

    def read(path: str) -> list[dict]:
        return pq.read_table(path).to_pylist()

    assert read(a[0]) == read(b[0]) and read(a[0]) != read(c[0])


def test_reward_right_and_wrong():
    assert toy_compute_score("7", "7") == 1.0
    assert toy_compute_score("7 3 1", "7") == 1.0  # only the first token counts
    assert toy_compute_score("3 7", "7") == 0.0
    assert toy_compute_score("copy", "7") == 0.0
    assert toy_compute_score("", "7") == 0.0
    assert default_compute_score(TOY_DATA_SOURCE, "5", "5", {"index": 0}) == 1.0


def test_reward_through_manager_on_token_ids(tok):
    rm = RewardManager(tok)
    right = tok.convert_tokens_to_ids(["9", "</s>"])
    wrong = tok.convert_tokens_to_ids(["=", "9", "</s>"])
    out = rm([right, wrong], [TOY_DATA_SOURCE] * 2, ["9", "9"], [None, None])
    assert out.scores.tolist() == [1.0, 0.0]


def test_chance_level_is_one_tenth(toy_files, tok):
    """Exact expected reward of a first token drawn uniformly, enumerated over every prompt."""
    rows = pq.read_table(toy_files[0]).to_pylist()

    def expected(candidates: list[str]) -> Fraction:
        total = Fraction(0)
        for row in rows:
            truth = row["reward_model"]["ground_truth"]
            hits = sum(toy_compute_score(c, truth) for c in candidates)
            total += Fraction(int(hits), len(candidates))
        return total / len(rows)

    assert expected(list(TOY_DIGITS)) == Fraction(1, 10)
    # Uniform over the whole vocabulary (special tokens decode to nothing and score 0): 1/|V|.
    vocab_texts = [tok.decode([i], skip_special_tokens=True) for i in range(len(tok))]
    assert expected(vocab_texts) == Fraction(1, len(tok))
