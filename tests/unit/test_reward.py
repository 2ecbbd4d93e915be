"""GSM8K rule reward, preprocessing rows, custom reward loading and RewardManager error handling."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from megatron_rl.demo.toy import TOY_DATA_SOURCE, build_toy_tokenizer
from megatron_rl.errors import NonFiniteRewardError
from megatron_rl.reward.rules import (
    RewardFunctionError,
    RewardManager,
    compute_score_gsm8k,
    default_compute_score,
    extract_solution,
    load_custom_reward_function,
)


def _load_preprocess_script():
    # Loaded by path: examples/ is not a package, and a bare "import gsm8k" could pick up another module.
    path = Path(__file__).resolve().parents[2] / "examples" / "data_preprocess" / "gsm8k.py"
    spec = importlib.util.spec_from_file_location("megatron_rl_examples_gsm8k", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gsm8k_preprocess = _load_preprocess_script()


@pytest.fixture(scope="module")
def tok():
    return build_toy_tokenizer()


# ---------------------------------------------------------------- extraction


# (response, ground truth, strict score, flexible score), verl's rule: the answer as written, compared
# with the ground truth string exactly; 1 right, 0 wrong or nothing extracted.
GSM8K_CASES = [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1, 1),
    ("#### 1,234", "1234", 1, 0),  # strict drops ","; flexible keeps "1,234"
    ("#### 1,234", "1,234", 0, 1),
    ("#### $12", "12", 0, 1),  # "$" right after "#### " is no answer for strict
    ("#### 72.", "72", 0, 0),  # the "." belongs to the match: "72." != "72"
    ("#### 72.", "72.", 1, 1),
    ("#### -5", "-5", 1, 1),
    ("#### - 5", "-5", 0, 0),  # strict: no match ("- 5"); flexible: last run "5"
    ("#### - 5", "5", 0, 1),
    ("#### 3.5", "3.5", 1, 1),
    ("#### 3.50", "3.5", 0, 0),
    ("first #### 1 then #### 2", "2", 1, 1),  # the last "####"
    ("first #### 1 then #### 2", "1", 0, 0),
    ("#### 5 dollars", "5", 1, 1),
    ("#### 5\n#### .", "5", 0, 1),  # a digit-less last "####" counts for strict ("." != "5")
    ("#### 5\n#### .", ".", 1, 0),  # flexible skips the lone "." and takes "5"
    ("so the answer is 42", "42", 0, 1),
    ("so the answer is 42.", "42", 0, 0),  # flexible keeps the "."
    ("no digits here", "0", 0, 0),
    ("####42", "42", 0, 1),  # strict needs the space after ####
    ("#### 42", " 42 ", 0, 0),  # the ground truth is not normalised
    ("", "1", 0, 0),
    ("The answer: #### 18", "18", 1, 1),
    ("#### 18 apples, 3 left", "18", 1, 0),  # flexible takes the last number, "3"
    ("#### 18 apples, 3 left", "3", 0, 1),
    ("#### 1000000", "1000000", 1, 1),
    ("#### 1,000,000", "1000000", 1, 0),
    ("#### 0", "0", 1, 1),
    ("#### 007", "7", 0, 0),
    ("####  7", "7", 0, 1),  # two spaces: strict needs exactly "#### " then the number
    ("#### 7\n", "7", 1, 1),
    ("#### 7 #### 8 #### 9", "9", 1, 1),
    ("#### 9.\nThat is all.", "9.", 1, 1),  # flexible skips the sentence's final "." and takes "9."
    ("12 apples", "12", 0, 1),
    ("-3 degrees", "-3", 0, 1),
    ("x=1, y=2", "2", 0, 1),
    ("1,5", "15", 0, 0),
    ("#### 1.5e3", "1.5", 1, 0),  # flexible: last run "3"
    ("#### 2/3", "2", 1, 0),
    ("costs $30", "30", 0, 1),
    ("#### 30%", "30", 1, 1),
    ("#### -0.5", "-0.5", 1, 1),
]


def test_gsm8k_cases_are_enough():
    assert len(GSM8K_CASES) >= 40


@pytest.mark.parametrize(("text", "truth", "strict", "flexible"), GSM8K_CASES)
def test_gsm8k_scores_as_verl(text, truth, strict, flexible):
    assert compute_score_gsm8k(text, truth) == strict
    assert compute_score_gsm8k(text, truth, method="flexible") == flexible


def test_gsm8k_ground_truth_of_another_type_never_matches():
    assert compute_score_gsm8k("#### 72", 72) == 0  # an int ground truth: verl compares strings
    assert compute_score_gsm8k("#### 72", 72, lenient=True) == 1


@pytest.mark.parametrize(
    ("text", "truth"),
    [
        ("#### $12", "12"),
        ("#### 72.", "72"),
        ("#### 1,234", "1,234"),
        ("#### 72", " 72 "),
        ("#### 5\n#### .", "5"),
    ],
)
def test_lenient_option_accepts_what_verl_refuses(text, truth):
    assert compute_score_gsm8k(text, truth) == 0
    assert compute_score_gsm8k(text, truth, lenient=True) == 1


def test_extract_solution_returns_the_answer_as_written():
    assert extract_solution("#### 1,234", "strict") == "1234"
    assert extract_solution("#### 1,234", "flexible") == "1,234"
    assert extract_solution("#### .", "strict") == "."
    assert extract_solution("...", "flexible") == "..."  # not a lone "."
    assert extract_solution(". .", "flexible") == "."  # only lone dots: the first one (verl's loop)
    assert extract_solution("no digits", "flexible") is None


def test_extract_only_looks_at_last_300_chars():
    early = "#### 17\n" + "x" * 300
    assert extract_solution(early, "strict") is None
    assert extract_solution(early, "flexible") is None
    assert extract_solution("#### 17\n" + "x" * 290, "strict") == "17"
    # The clip cuts into an early number: only its in-window digits are seen.
    assert extract_solution("12345" + "y" * 298, "flexible") == "45"


def test_extract_bad_method():
    with pytest.raises(ValueError):
        extract_solution("#### 1", "loose")


def test_compute_score_gsm8k():
    assert compute_score_gsm8k("work\n#### 1,234", "1234") == 1.0  # the preprocessed ground truth
    assert compute_score_gsm8k("work\n#### 1235", "1234") == 0.0
    assert compute_score_gsm8k("work\n#### 1235", "1234", format_score=0.1) == 0.1
    assert compute_score_gsm8k("the answer is 1234", "1234", format_score=0.1) == 0.0
    assert compute_score_gsm8k("the answer is 1234", "1234", method="flexible") == 1.0
    assert compute_score_gsm8k("#### 18", "18", score=2.0) == 2.0


def test_default_compute_score_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("gsm8k", "#### 5", "6") == 0.0
    assert default_compute_score(TOY_DATA_SOURCE, "3 1", "3") == 1.0
    with pytest.raises(NotImplementedError) as excinfo:
        default_compute_score("my/dataset", "x", "y")
    msg = str(excinfo.value)
    assert (
        "my/dataset" in msg and "custom_reward_function.path" in msg and "custom_reward_function.name" in msg
    )


# ---------------------------------------------------------------- preprocessing

EXAMPLE = {
    "question": "A shop sold 1,000 pens and 234 pencils. How many items?",
    "answer": "1,000 + 234 = <<1000+234=1234>>1,234\n#### 1,234",
}


def test_make_row():
    row = gsm8k_preprocess.make_row(EXAMPLE, 7, "train")
    assert row["data_source"] == "openai/gsm8k"
    assert row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1234"}
    assert row["prompt"] == [
        {
            "role": "user",
            "content": EXAMPLE["question"]
            + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert row["extra_info"] == {
        "split": "train",
        "index": 7,
        "answer": EXAMPLE["answer"],
        "question": EXAMPLE["question"],
    }
    # The reference solution itself earns full reward against its own ground truth.
    assert compute_score_gsm8k(EXAMPLE["answer"], row["reward_model"]["ground_truth"]) == 1.0


def test_make_row_without_marker():
    with pytest.raises(ValueError, match="test example 3"):
        gsm8k_preprocess.make_row({"question": "q", "answer": "42"}, 3, "test")


def test_preprocess_takes_the_first_numeric_final_answer():
    assert gsm8k_preprocess.extract_ground_truth("so 5 + 0 = 5\n#### 5 dollars") == "5"
    assert gsm8k_preprocess.extract_ground_truth("#### 1,234\n#### 99") == "1234"  # the first one
    assert gsm8k_preprocess.extract_ground_truth("#### -7") == "-7"
    with pytest.raises(ValueError, match="#### <number>"):
        gsm8k_preprocess.extract_ground_truth("#### seven")


def test_preprocess_cli_local_jsonl(tmp_path):
    import json

    src = tmp_path / "src"
    src.mkdir()
    for split, n in (("train", 3), ("test", 2)):
        with open(src / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(EXAMPLE) + "\n" for _ in range(n))
    out = gsm8k_preprocess.main(["--local_dir", str(tmp_path / "out"), "--local_dataset_path", str(src)])
    train = pq.read_table(out["train"]).to_pylist()
    test = pq.read_table(out["test"]).to_pylist()
    assert len(train) == 3 and len(test) == 2
    assert train[2]["extra_info"]["index"] == 2 and test[0]["extra_info"]["split"] == "test"
    assert train[0]["reward_model"]["ground_truth"] == "1234"


# ---------------------------------------------------------------- custom reward function


def test_load_custom_reward_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(solution_str.strip() == ground_truth) + bonus\n"
        "NOT_A_FUNCTION = 3\n"
    )
    fn = load_custom_reward_function(str(path), "compute_score")
    assert fn("d", " 5 ", "5") == 1.0

    with pytest.raises(FileNotFoundError, match=r"custom_reward_function\.path"):
        load_custom_reward_function(str(tmp_path / "missing.py"), "compute_score")
    with pytest.raises(AttributeError) as excinfo:
        load_custom_reward_function(str(path), "score_fn")
    assert "custom_reward_function.name" in str(excinfo.value) and "compute_score" in str(excinfo.value)
    with pytest.raises(TypeError, match="not callable"):
        load_custom_reward_function(str(path), "NOT_A_FUNCTION")

    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match=r"custom_reward_function\.path"):
        load_custom_reward_function(str(broken), "compute_score")


def test_reward_manager_with_custom_function(tmp_path, tok):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    out = {'score': float(solution_str.split()[0] == ground_truth) + bonus, 'acc': 1.0}\n"
        "    if solution_str.startswith('4'):\n"
        "        out['wrong_digit'] = 1\n"
        "    return out\n"
    )
    fn = load_custom_reward_function(str(path), "compute_score")
    rm = RewardManager(tok, compute_score=fn, reward_kwargs={"bonus": 0.5})
    ids = [tok.convert_tokens_to_ids(["3", "</s>"]), tok.convert_tokens_to_ids(["4"])]
    out = rm(ids, ["x", "x"], ["3", "3"], [None, None])
    assert out.scores.tolist() == [1.5, 0.5] and out.num_errors == 0
    # the extra keys come back per sample; a key a sample did not return is NaN there
    assert out.extras["acc"].tolist() == [1.0, 1.0]
    assert math.isnan(out.extras["wrong_digit"][0]) and out.extras["wrong_digit"][1] == 1.0


# ---------------------------------------------------------------- RewardManager


def _ids(tok, words: str) -> list[int]:
    return tok.convert_tokens_to_ids(words.split())


def test_reward_manager_default_scores(tok):
    rm = RewardManager(tok)
    responses = [_ids(tok, "7 </s>"), _ids(tok, "2 </s> <pad>"), _ids(tok, "<s> 5")]
    out = rm(responses, [TOY_DATA_SOURCE] * 3, ["7", "7", "5"], [{}, {}, {}])
    assert out.scores.dtype == torch.float32 and out.scores.shape == (3,)
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert out.num_errors == 0 and out.extras == {}


def test_reward_manager_one_failure_is_logged_and_counted(tok, caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "boom":
            raise ZeroDivisionError("bad sample")
        return 1.0

    rm = RewardManager(tok, compute_score=flaky)
    responses = [_ids(tok, "1"), _ids(tok, "copy 9 9 ="), _ids(tok, "3")]
    with caplog.at_level(logging.ERROR, logger="megatron_rl.reward.rules"):
        out = rm(responses, ["a", "src/b", "a"], ["1", "boom", "3"], [None, None, None])
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert out.num_errors == 1
    errors = [r for r in caplog.records if r.name == "megatron_rl.reward.rules"]
    assert len(errors) == 1
    msg = errors[0].getMessage()
    assert "sample 1" in msg and "src/b" in msg and "bad sample" in msg and "copy 9 9 =" in msg


def test_reward_manager_non_finite_score_stops_the_run_naming_the_sample(tok):
    def nan_once(data_source, solution_str, ground_truth, extra_info=None):
        return float("nan") if ground_truth == "x" else 0.5

    # one NaN would void the step's update: refused, not scored 0 and counted
    with pytest.raises(NonFiniteRewardError, match=r"reward function returned nan .* on sample 1"):
        RewardManager(tok, compute_score=nan_once)(
            [_ids(tok, "1"), _ids(tok, "2")], ["a", "a"], ["y", "x"], [None, None]
        )


def test_reward_manager_all_failures_raise(tok):
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError("missing field")

    rm = RewardManager(tok, compute_score=broken)
    with pytest.raises(RewardFunctionError, match="failed on all of the batch's 2 samples") as excinfo:
        rm([_ids(tok, "1"), _ids(tok, "2")], ["a", "a"], ["1", "2"], [None, None])
    assert isinstance(excinfo.value.__cause__, KeyError)


def test_reward_manager_unknown_data_source_raises(tok):
    with pytest.raises(RuntimeError) as excinfo:
        RewardManager(tok)([_ids(tok, "1")], ["unknown/src"], ["1"], [None])
    assert isinstance(excinfo.value.__cause__, NotImplementedError)
    assert "custom_reward_function.path" in str(excinfo.value)


# ---------------------------------------------------------------- hung or exiting reward functions


def test_a_hung_reward_function_stops_at_its_timeout_naming_it(tok):
    import threading
    import time

    release = threading.Event()

    def hangs(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "2":
            release.wait(60)
        return 1.0

    rm = RewardManager(tok, compute_score=hangs, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RewardFunctionError) as excinfo:
        rm([_ids(tok, "1"), _ids(tok, "2")], ["a", "src/slow"], ["1", "2"], [None, None])
    assert time.monotonic() - t0 < 5
    msg = str(excinfo.value)
    assert (
        "hangs" in msg
        and "sample 1" in msg
        and "src/slow" in msg
        and "custom_reward_function.timeout_s" in msg
    )
    release.set()
    # the manager recovers: a new worker serves the next batch
    assert rm([_ids(tok, "1")], ["a"], ["1"], [None]).scores.tolist() == [1.0]


def test_a_reward_function_that_exits_is_named(tok):
    def quits(data_source, solution_str, ground_truth, extra_info=None):
        sys.exit(3)

    with pytest.raises(
        RewardFunctionError, match=r"quits exited the process \(SystemExit\(3\)\) on sample 0"
    ):
        RewardManager(tok, compute_score=quits)([_ids(tok, "1")], ["a"], ["1"], [None])


def test_a_reward_function_failing_on_too_many_samples_stops_the_run_naming_the_key(tok):
    from megatron_rl.config import load_config

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "boom":
            raise ZeroDivisionError("bad sample")
        return 1.0

    responses = [_ids(tok, "1")] * 4
    one, two = ["1", "boom", "3", "4"], ["1", "boom", "boom", "4"]
    rm = RewardManager(tok, compute_score=flaky, max_error_fraction=0.25)
    assert rm(responses, ["a"] * 4, one, [None] * 4).num_errors == 1  # 1 of 4: within 0.25
    with pytest.raises(
        RewardFunctionError, match=r"failed on 2 of the batch's 4 samples.*max_error_fraction=0.25"
    ):
        rm(responses, ["a"] * 4, two, [None] * 4)
    lenient = RewardManager(tok, compute_score=flaky)  # 1.0: only a batch that fails whole
    assert lenient(responses, ["a"] * 4, two, [None] * 4).num_errors == 2
    with pytest.raises(RewardFunctionError, match="failed on all of the batch's 4 samples"):
        lenient(responses, ["a"] * 4, ["boom"] * 4, [None] * 4)
    assert load_config(None, []).custom_reward_function.max_error_fraction == 0.1
