"""A reward model held in Megatron shards (``build_model(role="reward")`` + ``compute_rm_scores``) scores
like HF's ``...ForSequenceClassification`` at TP1 (DP2), TP2 (with and without sequence parallelism)
and PP2, one after another in one torchrun/gloo launch of 2 processes, over Llama, Qwen2 and Qwen3.

Oracle: HF's ``logits[:, 0]`` (the score head at the last non-pad token) on the same padded batch of 7
sequences of 1..9 tokens, right padded (HF's convention, with pad_token_id) and left padded. O(1) random
weights make scores O(1) and spread out, so a wrong layout, position or head cannot hide:

- scores vs HF: 1e-4 absolute (fp32);
- negative controls through the same code, each > 100x the tolerance: the token before the last, and
  a score head with its hidden dimension reversed;
- torch_dist round trip: saved at TP2, loaded at PP2 (architecture from the checkpoint's metadata),
  the same scores; an actor refuses that checkpoint.

Loading errors (num_labels != 1, a causal LM as reward model) are checked in-process.
"""

from __future__ import annotations

import pytest

from tests.conftest import read_json

ARCHS = {"llama": False, "qwen2": True, "qwen3": False}  # arch: tie_word_embeddings
LAYOUTS = {  # name: (tp, pp); 2 processes each, TP1 is DP2
    "tp1": (1, 1),
    "tp2": (2, 1),
    "pp2": (1, 2),
}
TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, dict]]:
    """{layout: {arch: result}}; TP2 saves the torch_dist checkpoints that PP2 loads."""
    from megatron_rl.models.random_hf import save_random_hf_model
    from tests.conftest import run_torchrun_runs

    root = tmp_path_factory.mktemp("rm")
    # Qwen2 with tie_word_embeddings (as RMs built on small Qwen2.5 models): the score head is never tied.
    dirs = {
        arch: save_random_hf_model(
            str(root / arch), arch, seed=21 + i, head="score", num_hidden_layers=2, tie_word_embeddings=tie
        )
        for i, (arch, tie) in enumerate(ARCHS.items())
    }
    models = [f"{arch}={d}" for arch, d in dirs.items()]
    td = root / "td"
    runs = []
    for name, (tp, pp) in LAYOUTS.items():  # in this order: TP2 saves before PP2 loads
        extra = ["--save-td", str(td)] if name == "tp2" else ["--load-td", str(td)] if name == "pp2" else []
        runs.append(
            ["--models", *models, "--tp", str(tp), "--pp", str(pp), "--out", str(root / name), *extra]
        )
    run_torchrun_runs("rm_scores", 2, runs)
    return {name: {arch: read_json(str(root / name / f"{arch}.json")) for arch in ARCHS} for name in LAYOUTS}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scores_match_hf(runs, layout, arch):
    r = runs[layout][arch]
    assert r["max_abs_score"] > 0.5 and r["score_spread"] > 0.2, "scores too small to expose a layout bug"
    assert r["diff_right"] < TOL, r["diff_right"]
    assert r["diff_left"] < TOL, r["diff_left"]
    assert r["rank_spread"] == 0.0, "scores differ between ranks"
    if layout == "tp2":
        assert r["diff_sequence_parallel"] < TOL, r["diff_sequence_parallel"]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_negative_controls_are_far_off(runs, layout, arch):
    r = runs[layout][arch]
    assert r["diff_wrong_position"] > 100 * TOL, r["diff_wrong_position"]
    assert r["diff_permuted_head"] > 100 * TOL, r["diff_permuted_head"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_torch_dist_round_trip(runs, arch):
    r = runs["pp2"][arch]
    assert r["td_format"] == "torch_dist" and r["td_args_equal"]
    assert r["diff_torch_dist"] < TOL, r["diff_torch_dist"]
    assert f"td/{arch} is a reward checkpoint" in r["actor_refused"], r["actor_refused"]


def test_load_errors_name_the_path(tmp_path):
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import check_score_head
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.weights.hf_io import HFReader

    rm = save_random_hf_model(str(tmp_path / "rm"), "qwen2", head="score", num_hidden_layers=1)
    args = load_model_args(rm)
    assert args.arch == "qwen2" and args.is_sequence_classifier
    check_score_head(HFReader(rm), args)  # a good one passes

    two = save_random_hf_model(
        str(tmp_path / "two"), "qwen2", head="score", num_labels=2, num_hidden_layers=1
    )
    with pytest.raises(ValueError, match=r"two.*num_labels=2"):
        load_model_args(two)
    with pytest.raises(ValueError, match=r"two: score.weight has shape \(2, 64\)"):
        check_score_head(HFReader(two), args)

    lm = save_random_hf_model(str(tmp_path / "lm"), "qwen2", num_hidden_layers=1)
    assert not load_model_args(lm).is_sequence_classifier
    with pytest.raises(KeyError, match=r"lm has no score.weight"):
        check_score_head(HFReader(lm), args)
