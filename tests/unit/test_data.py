"""PromptDataset, ResumableDistributedSampler and collate_left_pad on parquet files written in a tmp dir."""

from __future__ import annotations

import itertools
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rl.data import PromptDataset, PromptItem, ResumableDistributedSampler, collate_left_pad
from megatron_rl.demo.toy import build_toy_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


def _row(digits: str, idx: int, **overrides) -> dict:
    row = {
        "data_source": "toy/copy_last_digit",
        "prompt": [{"role": "user", "content": "copy " + " ".join(digits)}],
        "ability": "copy",
        "reward_model": {"style": "rule", "ground_truth": digits[-1]},
        "extra_info": {"split": "train", "index": idx},
    }
    row.update(overrides)
    return row


def _write(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _ids(tok, digits: str) -> list[int]:
    # "copy d1 .. dn = " renders to the words copy, d1..dn, =
    return [tok.convert_tokens_to_ids(t) for t in ["copy", *digits, "="]]


# Token lengths: "12" -> 4, "1234" -> 6, "123456789" -> 11.
DIGITS = ["12", "123456789", "1234", "987654321", "55"]


def test_rows_tokenized_with_chat_template(tmp_path, tok):
    path = _write(tmp_path, "a.parquet", [_row(d, i) for i, d in enumerate(DIGITS)])
    ds = PromptDataset(path, tok, max_prompt_length=64)
    assert len(ds) == len(DIGITS) and ds.num_filtered == 0
    item = ds[1]
    assert isinstance(item, PromptItem)
    assert item.prompt_ids == _ids(tok, "123456789")
    assert item.data_source == "toy/copy_last_digit"
    assert item.ground_truth == "9"
    assert item.extra_info == {"split": "train", "index": 1}
    assert item.index == 1


def test_multiple_files_concatenate_in_order(tmp_path, tok):
    a = _write(tmp_path, "a.parquet", [_row("12", 0), _row("34", 1)])
    b = _write(tmp_path, "b.parquet", [_row("56", 0)])
    ds = PromptDataset([a, b], tok, max_prompt_length=64)
    assert [ds[i].ground_truth for i in range(len(ds))] == ["2", "4", "6"]
    assert [ds[i].index for i in range(len(ds))] == [0, 1, 2]


def test_truncation_error_names_row_length_and_keys(tmp_path, tok):
    path = _write(tmp_path, "a.parquet", [_row(d, i) for i, d in enumerate(DIGITS)])
    with pytest.raises(ValueError) as excinfo:
        PromptDataset(path, tok, max_prompt_length=8, truncation="error", filter_overlong_prompts=False)
    msg = str(excinfo.value)
    assert "row 1" in msg and "11 tokens" in msg and "8" in msg
    for key in ("data.max_prompt_length", "data.truncation", "data.filter_overlong_prompts"):
        assert key in msg


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_keeps_the_right_tokens(tmp_path, tok, mode):
    path = _write(tmp_path, "a.parquet", [_row(d, i) for i, d in enumerate(DIGITS)])
    ds = PromptDataset(path, tok, max_prompt_length=6, truncation=mode, filter_overlong_prompts=False)
    assert len(ds) == len(DIGITS) and ds.num_filtered == 0
    full = _ids(tok, "123456789")
    expected = {"left": full[-6:], "right": full[:6], "middle": full[:3] + full[-3:]}[mode]
    assert ds[1].prompt_ids == expected
    assert ds[2].prompt_ids == _ids(tok, "1234")  # exactly at the limit: untouched
    assert all(len(ds[i].prompt_ids) <= 6 for i in range(len(ds)))


def test_overlong_filter_drops_only_overlong_rows(tmp_path, tok, caplog):
    path = _write(tmp_path, "a.parquet", [_row(d, i) for i, d in enumerate(DIGITS)])
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data"):
        ds = PromptDataset(path, tok, max_prompt_length=6, truncation="error", filter_overlong_prompts=True)
    assert ds.num_filtered == 2
    assert ds.filtered_indices == [1, 3]
    assert [ds[i].index for i in range(len(ds))] == [0, 2, 4]
    assert [ds[i].ground_truth for i in range(len(ds))] == ["2", "4", "5"]
    assert ds[1].prompt_ids == _ids(tok, "1234")
    records = [r for r in caplog.records if r.name == "megatron_rl.data"]
    assert len(records) == 1 and "Filtered 2 of 5" in records[0].getMessage()


@pytest.mark.parametrize("column", ["prompt", "data_source", "reward_model"])
def test_missing_column_error(tmp_path, tok, column):
    rows = [_row("12", 0)]
    for r in rows:
        del r[column]
    path = _write(tmp_path, "bad.parquet", rows)
    with pytest.raises(ValueError) as excinfo:
        PromptDataset(path, tok, max_prompt_length=64)
    msg = str(excinfo.value)
    assert path in msg and repr(column) in msg and "verl's format" in msg


def test_all_prompts_filtered_is_an_error(tmp_path, tok):
    path = _write(tmp_path, "a.parquet", [_row("123456789", 0)])
    with pytest.raises(ValueError, match=r"all 1 prompts are longer than data\.max_prompt_length=4"):
        PromptDataset(path, tok, max_prompt_length=4)


def test_extra_info_optional_and_custom_prompt_key(tmp_path, tok):
    row = _row("12", 0)
    row["question"] = row.pop("prompt")
    del row["extra_info"]
    path = _write(tmp_path, "a.parquet", [row])
    ds = PromptDataset(path, tok, max_prompt_length=64, prompt_key="question")
    assert ds[0].extra_info == {} and ds[0].prompt_ids == _ids(tok, "12")


def test_bad_truncation_mode(tmp_path, tok):
    path = _write(tmp_path, "a.parquet", [_row("12", 0)])
    with pytest.raises(ValueError, match=r"data\.truncation"):
        PromptDataset(path, tok, max_prompt_length=64, truncation="both")


# ---------------------------------------------------------------- sampler


def _epoch(sampler):
    return [list(b) for b in sampler.iter_epoch()]


def test_sampler_shards_disjoint_and_cover_global_batch():
    n, bs, dp = 100, 16, 4
    ranks = [ResumableDistributedSampler(n, bs, r, dp, seed=3) for r in range(dp)]
    per_rank = [_epoch(s) for s in ranks]
    assert all(len(p) == len(ranks[0]) == n // bs for p in per_rank)
    seen: set[int] = set()
    for step in range(n // bs):
        shards = [per_rank[r][step] for r in range(dp)]
        assert all(len(s) == bs // dp for s in shards)
        union = [i for s in shards for i in s]
        assert len(set(union)) == bs
        assert union == ranks[0].global_batch(0, step)
        assert not seen & set(union)  # no prompt repeats within an epoch
        seen |= set(union)


def test_sampler_deterministic_per_seed_and_epoch():
    a = ResumableDistributedSampler(50, 10, 0, 1, seed=7)
    b = ResumableDistributedSampler(50, 10, 0, 1, seed=7)
    c = ResumableDistributedSampler(50, 10, 0, 1, seed=8)
    a0, b0, c0 = _epoch(a), _epoch(b), _epoch(c)
    assert a0 == b0 and a0 != c0
    a1 = _epoch(a)  # iteration moved a to epoch 1
    assert a.state_dict()["epoch"] == 2
    assert a1 != a0 and sorted(i for b in a1 for i in b) == sorted(i for b in a0 for i in b)
    b.set_epoch(1)
    assert _epoch(b) == a1
    unshuffled = ResumableDistributedSampler(50, 10, 0, 1, seed=7, shuffle=False)
    assert _epoch(unshuffled)[0] == list(range(10))


@pytest.mark.parametrize("consumed", [0, 1, 3, 5])
def test_sampler_resume_yields_exactly_the_remaining_batches(consumed):
    ref = ResumableDistributedSampler(53, 10, 1, 2, seed=11)
    full = _epoch(ref) + _epoch(ref)  # two epochs, 5 steps each

    run = ResumableDistributedSampler(53, 10, 1, 2, seed=11)
    it = iter(run)
    got = [next(it) for _ in range(consumed)]
    state = run.state_dict()

    resumed = ResumableDistributedSampler(53, 10, 1, 2, seed=11)
    resumed.load_state_dict(state)
    rest = _epoch(resumed) if consumed < 5 else []
    rest += _epoch(resumed)
    assert got + rest == full

    # The same through the endless iterator a trainer steps with next().
    again = ResumableDistributedSampler(53, 10, 1, 2, seed=11)
    again.load_state_dict(state)
    assert got + list(itertools.islice(iter(again), 10 - consumed)) == full


def test_sampler_iter_is_endless_across_epochs():
    s = ResumableDistributedSampler(30, 10, 0, 1, seed=5)
    stream = list(itertools.islice(iter(s), 7))
    ref = ResumableDistributedSampler(30, 10, 0, 1, seed=5)
    assert stream == _epoch(ref) + _epoch(ref) + _epoch(ref)[:1]
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 1


def test_sampler_drawn_epoch_counts_every_draw_and_survives_a_resume():
    """training/epoch is the sampler's drawn_epoch: extra draws (the group filter's refills) move it,
    the last batch of an epoch still belongs to that epoch, and a resume at the boundary keeps it."""
    s = ResumableDistributedSampler(30, 10, 0, 1, seed=7)  # 3 batches per epoch
    it = iter(s)
    seen = []
    for _ in range(7):
        next(it)
        seen.append(s.drawn_epoch)
    assert seen == [0, 0, 0, 1, 1, 1, 2]
    # a step count alone (the former formula) says epoch 0 for a 3rd step that drew 2 refills
    assert (3 - 1) // len(s) == 0 and seen[2 + 2 + 1] == 1
    fresh = ResumableDistributedSampler(30, 10, 0, 1, seed=7)
    assert fresh.drawn_epoch == 0
    s = ResumableDistributedSampler(30, 10, 0, 1, seed=7)
    it = iter(s)
    for _ in range(3):
        next(it)
    resumed = ResumableDistributedSampler(30, 10, 0, 1, seed=7)
    resumed.load_state_dict(s.state_dict())  # saved after the epoch's last batch: (1, 0)
    assert s.state_dict()["epoch"] == 1 and resumed.drawn_epoch == s.drawn_epoch == 0


def test_sampler_state_mismatch_rejected():
    state = ResumableDistributedSampler(50, 10, 0, 1, seed=1).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        ResumableDistributedSampler(50, 5, 0, 1, seed=1).load_state_dict(state)


def test_sampler_drop_last_false_pads_last_batch():
    s = ResumableDistributedSampler(25, 10, 0, 2, seed=0, drop_last=False)
    batches = _epoch(s)
    assert len(batches) == len(s) == 3
    assert all(len(b) == 5 for b in batches)
    # A batch larger than the data (e.g. validation) still gives every rank a full slice.
    ranks = [
        ResumableDistributedSampler(3, 8, r, 4, seed=0, shuffle=False, drop_last=False) for r in range(4)
    ]
    assert [_epoch(s) for s in ranks] == [[[0, 1]], [[2, 0]], [[1, 2]], [[0, 1]]]


def test_sampler_batch_size_not_divisible():
    with pytest.raises(ValueError, match=r"data\.train_batch_size"):
        ResumableDistributedSampler(100, 10, 0, 4, seed=0)
    with pytest.raises(ValueError, match=r"data\.train_batch_size"):
        ResumableDistributedSampler(5, 8, 0, 2, seed=0)


# ---------------------------------------------------------------- collate


def test_collate_left_pad():
    items = [PromptItem([5, 6, 7], "s", "7"), [8], PromptItem([9, 10], "s", "10")]
    input_ids, mask = collate_left_pad(items, pad_token_id=0)
    assert input_ids.dtype == torch.long and mask.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_collate_dataset_items(tmp_path, tok):
    path = _write(tmp_path, "a.parquet", [_row("12", 0), _row("1234", 1)])
    ds = PromptDataset(path, tok, max_prompt_length=64)
    input_ids, mask = collate_left_pad([ds[0], ds[1]], tok.pad_token_id)
    assert input_ids.shape == (2, 6)
    assert input_ids[0].tolist() == [tok.pad_token_id] * 2 + _ids(tok, "12")
    assert mask.sum(dim=1).tolist() == [4, 6]


def test_unreadable_and_missing_files_are_data_errors(tmp_path, tok):
    from megatron_rl.config import DataError

    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=rf"data file '{garbage}' is not a readable parquet file \("):
        PromptDataset(str(garbage), tok, max_prompt_length=64)
    with pytest.raises(DataError, match=r"does not exist \(check data.train_files / data.val_files\)"):
        PromptDataset(str(tmp_path / "missing.parquet"), tok, max_prompt_length=64)


def test_rows_the_built_in_rules_cannot_score_fail_up_front(tmp_path, tok):
    from megatron_rl.config import DataError
    from megatron_rl.reward.rules import RULE_DATA_SOURCES

    good = _write(tmp_path, "good.parquet", [_row("12", 0)])
    bad_source = _write(tmp_path, "src.parquet", [_row("12", 0), _row("34", 1, data_source="my/task")])
    null_truth = _write(
        tmp_path, "null.parquet", [_row("12", 0, reward_model={"style": "rule", "ground_truth": None})]
    )
    PromptDataset(good, tok, 16, rule_sources=RULE_DATA_SOURCES)
    with pytest.raises(
        DataError, match=r"src\.parquet: row 1 has data_source='my/task'.*custom_reward_function\.path"
    ):
        PromptDataset([good, bad_source], tok, 16, rule_sources=RULE_DATA_SOURCES)
    with pytest.raises(DataError, match=r"null\.parquet: row 0 .*ground_truth = null"):
        PromptDataset(null_truth, tok, 16, rule_sources=RULE_DATA_SOURCES)
    # a custom reward function decides for itself (no rule check)
    assert len(PromptDataset(bad_source, tok, 16)) == 2
