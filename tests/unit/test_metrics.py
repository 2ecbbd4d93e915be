"""Step metrics (verl names, hand-computed values), console grouping, and the logger sinks."""

import importlib.util
import json
import os

import pytest
import torch

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.run.metrics import MetricsLogger, Timer, data_metrics, format_console
from tests.conftest import run_forked_ranks


def tiny_batch() -> RolloutBatch:
    # 2 sequences: prompt lengths 2 and 3 (left padded to 3), response lengths 2 and 1 (padded to 2).
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    responses = torch.tensor([[3, 4], [3, 0]])
    response_mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    b = RolloutBatch.from_tokens(prompts, prompt_mask, responses, response_mask, [SeqMeta("a"), SeqMeta("b")])
    b.token_level_scores = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    b.token_level_rewards = torch.tensor([[0.0, 0.8], [0.5, 0.0]])
    b.advantages = torch.tensor([[1.0, -1.0], [3.0, 99.0]])  # 99 sits on padding: must not count
    b.returns = torch.tensor([[1.0, 1.0], [0.0, 7.0]])
    b.values = torch.tensor([[0.5, 1.0], [0.0, 7.0]])
    return b


def test_data_metrics_by_hand():
    m = data_metrics(tiny_batch(), max_prompt_length=3, max_response_length=2, dp_group=None)
    assert m["critic/score/mean"] == pytest.approx(0.75)  # (1.0 + 0.5) / 2 sequences
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.5
    assert m["critic/rewards/mean"] == pytest.approx(0.65)  # (0.8 + 0.5) / 2
    assert m["critic/advantages/mean"] == pytest.approx(1.0)  # (1 - 1 + 3) / 3 real tokens
    assert m["critic/advantages/max"] == 3.0  # the 99 on padding is ignored
    assert m["response_length/mean"] == pytest.approx(1.5)
    assert m["response_length/clip_ratio"] == pytest.approx(0.5)  # one of two hit max_response_length=2
    assert m["prompt_length/mean"] == pytest.approx(2.5)
    assert m["prompt_length/clip_ratio"] == pytest.approx(0.5)  # one prompt of 3 tokens, at the limit 3
    assert m["response/aborted_ratio"] == 0.0
    # returns over real tokens [1, 1, 0]: var = 2/9; residuals [0.5, 0, 0]: var = 1/18
    assert m["critic/vf_explained_var"] == pytest.approx(1 - (1 / 18) / (2 / 9 + 1e-5), rel=1e-6)


def test_empty_responses_count_as_aborted_and_rejected_tokens_leave_the_lengths_alone():
    b = tiny_batch()
    b.attention_mask[1, 3:] = 0  # the second response is empty
    b.response_mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # a rejected token is not a shorter response
    m = data_metrics(b, max_prompt_length=4, max_response_length=2, dp_group=None)
    assert m["response/aborted_ratio"] == pytest.approx(0.5)
    assert m["response_length/mean"] == pytest.approx(1.0)  # lengths 2 and 0
    assert m["prompt_length/clip_ratio"] == 0.0


def _shard(b: RolloutBatch, rows: slice) -> RolloutBatch:
    out = RolloutBatch.from_tokens(
        b.prompts[rows],
        b.attention_mask[rows, : b.prompts.shape[1]],
        b.responses[rows],
        b.response_mask[rows],
        b.meta[rows],
    )
    for k in ("token_level_scores", "token_level_rewards", "advantages", "returns", "values"):
        setattr(out, k, getattr(b, k)[rows])
    return out


def _metrics_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    m = data_metrics(_shard(tiny_batch(), slice(rank, rank + 1)), 3, 2, dist.new_group([0, 1]))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(m, f)
    dist.destroy_process_group()


def test_data_metrics_over_data_parallel_ranks(tmp_path):
    """Each of two ranks holds one sequence; the metrics equal those of one process holding both."""
    run_forked_ranks(_metrics_worker, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    whole = data_metrics(tiny_batch(), max_prompt_length=3, max_response_length=2, dp_group=None)
    for m in ranks:
        assert m.keys() == whole.keys()
        for k, v in whole.items():
            assert m[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_console_groups_in_order():
    text = format_console(3, {"perf/throughput": 1.0, "actor/pg_loss": 0.5, "critic/score/mean": 0.25})
    lines = text.splitlines()
    assert lines[0] == "step 3"
    assert (
        lines[1].split()[0] == "actor" and lines[2].split()[0] == "reward" and lines[3].split()[0] == "perf"
    )


def test_timer_accumulates_per_phase():
    t = Timer(torch.device("cpu"))
    for _ in range(2):
        with t("gen"):
            pass
    out = t.pop()
    assert set(out) == {"timing_s/gen"} and out["timing_s/gen"] >= 0
    assert t.pop() == {}


def test_jsonl_sink(tmp_path):
    def run(begin: int | None, steps: list[int]) -> None:
        lg = MetricsLogger(["jsonl"], str(tmp_path), "p", "e", {}, enabled=True)
        if begin is not None:
            lg.begin(begin)
        for step in steps:
            lg.log(step, {"actor/pg_loss": 1.0 / step})
        lg.close()

    def steps(name: str = "metrics.jsonl") -> list[int]:
        return [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()]

    run(None, [1, 2])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "actor/pg_loss": 1.0}, {"step": 2, "actor/pg_loss": 0.5}]
    run(1, [2, 3])  # resumed from a step-1 checkpoint: step 2 is logged again, once
    assert steps() == [1, 2, 3]
    run(0, [1])  # a fresh run: the earlier run's file is set aside, nothing appended
    assert steps() == [1] and steps("metrics.1.jsonl") == [1, 2, 3]
    run(0, [1, 2])
    assert steps("metrics.2.jsonl") == [1]


def test_a_resumed_run_replays_its_checkpoint_row_once(tmp_path, capsys):
    """The row a checkpoint keeps is written after a resume when metrics.jsonl lacks it (the run died
    between publishing the checkpoint and writing the row), never twice, never to the console."""

    def resumed(row: dict[str, float] | None) -> list[dict]:
        lg = MetricsLogger(["jsonl", "console"], str(tmp_path), "p", "e", {}, enabled=True)
        lg.begin(2)
        lg.replay(2, row)
        lg.close()
        return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "a": 1.0}) + "\n")
    assert resumed({"a": 2.0}) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    assert resumed({"a": 9.0}) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]  # already there
    assert resumed(None)[-1] == {"step": 2, "a": 2.0}
    assert capsys.readouterr().out == ""


def test_console_prints_a_line_per_step_and_the_block_every_n(capsys, tmp_path):
    lg = MetricsLogger(["console"], str(tmp_path), "p", "e", {}, enabled=True, block_freq=2)
    m = {"critic/score/mean": 0.5, "actor/pg_loss": 0.25, "timing_s/step": 1.5}
    m["val-core/x/reward/mean@1"] = 0.75
    for step in (1, 2, 3):
        lg.log(step, m, last=step == 3)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 1  score=0.5  pg_loss=0.25  step_s=1.5  val-core/x/reward/mean@1=0.75"
    assert out[1] == "step 2" and out[2].startswith("  actor")  # the grouped block at step 2
    assert "step 3" in out and out[-1].startswith("  ")  # and at the last step
    # console only (verl's default logger): the file for tools is written all the same
    lg.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["actor/pg_loss"] == 0.25


def test_summary_names_the_metrics_file_whatever_the_logger(tmp_path, capsys):
    from megatron_rl.config import load_config
    from megatron_rl.run.metrics import write_summary

    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path}", "trainer.logger=console"])
    jsonl = os.path.join(cfg.trainer.log_dir, "metrics.jsonl")
    write_summary(cfg, 3, {"critic/score/mean": 0.5}, None, jsonl)
    out = capsys.readouterr().out
    assert f"metrics:    {jsonl}   plot: python -m megatron_rl.run.plot {cfg.trainer.log_dir}" in out
    assert json.loads((tmp_path / "summary.json").read_text())["metrics"] == jsonl


def test_progress_bar_is_off_when_output_is_not_a_terminal(capsys):
    from megatron_rl.run.metrics import progress_bar

    bar = progress_bar(10, 0, enabled=True)  # pytest captures stdout/stderr: not terminals
    assert bar.disable
    bar.update(1)
    bar.write("step 1  score=0.5")
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "step 1  score=0.5\n" and captured.err == ""


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_missing_tensorboard_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        MetricsLogger(["tensorboard"], str(tmp_path), "p", "e", {}, enabled=True)


def test_disabled_logger_writes_nothing(tmp_path):
    lg = MetricsLogger(["jsonl"], str(tmp_path / "x"), "p", "e", {}, enabled=False)
    lg.log(1, {"a": 1.0})
    assert not (tmp_path / "x").exists()
