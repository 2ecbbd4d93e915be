"""Sampling pieces of the transformers engine against hand computations; parameter validation."""

import math

import pytest
import torch

from megatron_rl.rollout.base import SamplingParams, oom_message
from megatron_rl.rollout.hf_engine import cut_response, filter_logits, sample_next


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda p: torch.isfinite(filter_logits(logits, 1.0, -1, p))[0].tolist()  # noqa: E731
    assert kept(0.7) == [False, True, False, True]  # 0.5 + 0.3 >= 0.7
    assert kept(0.5) == [False, True, False, False]  # 0.5 alone reaches 0.5
    assert kept(0.81) == [False, True, True, True]
    assert kept(1.0) == [True, True, True, True]


def test_top_k_and_temperature():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    x = filter_logits(logits, 2.0, 2, 1.0)
    assert torch.isfinite(x)[0].tolist() == [False, True, True, False]
    assert x[0, 1].item() == 2.0 and x[0, 2].item() == 1.5  # divided by the temperature


def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3])).repeat(20000, 1)
    params = SamplingParams(temperature=1.0, top_p=0.7)
    tok, lp = sample_next(logits, params, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    expected = torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8])
    assert (freq - expected).abs().max() < 0.02
    # log-probs are of the untruncated tempered distribution (what the trainer recomputes)
    assert torch.allclose(lp[tok == 1], torch.tensor(math.log(0.5)), atol=1e-6)


def test_same_seed_same_samples_and_greedy_ignores_the_generator():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.7, top_k=10)
    a, _ = sample_next(logits, p, torch.Generator().manual_seed(5))
    b, _ = sample_next(logits, p, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    g, glp = sample_next(logits, SamplingParams(temperature=0.0), torch.Generator().manual_seed(9))
    assert torch.equal(g, logits.argmax(-1))
    assert torch.allclose(glp, torch.log_softmax(logits, -1).max(-1).values)


def test_cut_response_keeps_the_stop_token():
    g = cut_response([5, 6, 2, 7], [0.1, 0.2, 0.3, 0.4], {2, 9})
    assert g.token_ids == [5, 6, 2] and g.logprobs == [0.1, 0.2, 0.3] and g.finish_reason == "stop"
    g = cut_response([5, 6], [0.1, 0.2], {2})
    assert g.token_ids == [5, 6] and g.finish_reason == "length"


@pytest.mark.parametrize(
    "kw,key",
    [
        (dict(n=0), "rollout.n"),
        (dict(max_new_tokens=0), "data.max_response_length"),
        (dict(top_p=0.0), "rollout.top_p"),
        (dict(top_k=0), "rollout.top_k"),
        (dict(temperature=-1.0), "rollout.temperature"),
    ],
)
def test_bad_sampling_params_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kw).check()


def test_greedy_flag_and_zero_temperature():
    assert SamplingParams(greedy=True).is_greedy and SamplingParams(temperature=0).is_greedy
    assert not SamplingParams().is_greedy


def test_oom_message_names_numbers_and_keys():
    msg = oom_message("SGLang", 64, 8, 300, 1024, 0.85, 8192, 2 * 2**30, 80 * 2**30)
    for s in (
        "64 prompts x n=8 = 512 sequences",
        "300 prompt + 1024 response",
        "gpu_memory_utilization=0.85",
        "max_num_batched_tokens=8192",
        "2.0 GiB free of 80.0 GiB",
        "data.max_response_length",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.max_num_batched_tokens",
    ):
        assert s in msg, s


def test_stop_ids_are_the_generation_config_eos_then_the_tokenizer_eos(tmp_path):
    import json

    from megatron_rl.demo.toy import build_toy_tokenizer
    from megatron_rl.rollout.base import stop_token_ids

    tok = build_toy_tokenizer()
    model = tmp_path / "model"
    model.mkdir()
    # A chat model whose turn ends with a token other than the tokenizer's EOS.
    end_of_turn = tok.eos_token_id + 3
    (model / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [end_of_turn, end_of_turn + 1]})
    )
    assert stop_token_ids(tok, [str(model)]) == [end_of_turn, end_of_turn + 1, tok.eos_token_id]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id}))
    assert stop_token_ids(tok, [str(model)]) == [tok.eos_token_id]  # no repeats
    # A directory without the file (a Megatron checkpoint) defers to the next one (the tokenizer's).
    megatron_dir = tmp_path / "mcore"
    megatron_dir.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": end_of_turn}))
    assert stop_token_ids(tok, [str(megatron_dir), str(model)]) == [end_of_turn, tok.eos_token_id]
    assert stop_token_ids(tok, [str(megatron_dir)]) == [tok.eos_token_id]


def test_generation_stops_at_the_generation_config_eos_not_only_the_tokenizer_eos():
    end_of_turn, tokenizer_eos = 7, 2
    g = cut_response([5, 7, 9, 2], [0.1, 0.2, 0.3, 0.4], {end_of_turn, tokenizer_eos})
    assert g.token_ids == [5, 7] and g.finish_reason == "stop"
    g = cut_response([5, 7, 9, 2], [0.1, 0.2, 0.3, 0.4], {tokenizer_eos})  # negative control
    assert g.token_ids == [5, 7, 9, 2]
