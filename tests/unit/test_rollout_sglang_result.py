"""SGLang results -> Generation without a GPU: every response token gets the engine's log-prob.

The dicts are built the way ``sglang.Engine.generate`` (0.5.17, skip_tokenizer_init) returns them:
``output_ids`` and ``meta_info`` with ``finish_reason`` and ``output_token_logprobs`` = (logprob,
token_id, text=None) per generated token, the matched stop token included.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from megatron_rl.rollout.sglang_outputs import to_generation

STOP = 2


def _result(output_ids, logprobs, finish_reason):
    return {
        "output_ids": list(output_ids),
        "meta_info": {
            "id": "0",
            "finish_reason": finish_reason,
            "prompt_tokens": 3,
            "completion_tokens": len(logprobs),
            "cached_tokens": 0,
            "input_token_logprobs": [(None, 11, None), (-2.5, 12, None), (-1.5, 13, None)],
            "output_token_logprobs": [(lp, tok, None) for lp, tok in logprobs],
        },
    }


def test_the_conversion_does_not_import_sglang():
    # a fresh interpreter: another test of the session may have imported sglang where it is installed
    code = (
        "import sys\n"
        "from megatron_rl.rollout.sglang_outputs import to_generation\n"
        "to_generation({'output_ids': [1], 'meta_info': {'finish_reason': {'type': 'length'}}}, False)\n"
        "assert 'sglang' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stopped_response_has_a_log_prob_per_token():
    out = _result([5, 6, STOP], [(-0.1, 5), (-0.2, 6), (-0.3, STOP)], {"type": "stop", "matched": STOP})
    g = to_generation(out, return_logprobs=True)
    assert g.token_ids == [5, 6, STOP]
    assert g.logprobs == [-0.1, -0.2, -0.3]  # the stop token's own log-prob, not a stand-in
    assert g.finish_reason == "stop"


def test_length_cut_response_has_a_log_prob_per_token():
    out = _result([5, 6, 7], [(-0.1, 5), (-0.2, 6), (-0.3, 7)], {"type": "length", "length": 3})
    g = to_generation(out, return_logprobs=True)
    assert (g.token_ids, g.logprobs, g.finish_reason) == ([5, 6, 7], [-0.1, -0.2, -0.3], "length")


def test_stop_token_trimmed_from_ids_takes_its_listed_log_prob():
    out = _result([5, 6], [(-0.1, 5), (-0.2, 6), (-0.3, STOP)], {"type": "stop", "matched": STOP})
    g = to_generation(out, return_logprobs=True)
    assert g.token_ids == [5, 6, STOP]
    assert g.logprobs == [-0.1, -0.2, -0.3]


def test_a_log_prob_the_engine_did_not_give_is_nan_not_dropped():
    out = _result([5, 6], [(-0.1, 5), (-0.2, 6)], {"type": "stop", "matched": STOP})
    g = to_generation(out, return_logprobs=True)
    assert g.token_ids == [5, 6, STOP]
    assert len(g.logprobs) == len(g.token_ids)  # one per token, as Generation promises
    assert g.logprobs[:2] == [-0.1, -0.2] and math.isnan(g.logprobs[2])


def test_log_probs_of_other_tokens_are_refused():
    out = _result([5, 6, STOP], [(-0.1, 5), (-0.2, 9), (-0.3, STOP)], {"type": "stop", "matched": STOP})
    with pytest.raises(RuntimeError, match="output_token_logprobs names token 9 at response position 1"):
        to_generation(out, return_logprobs=True)


def test_without_log_probs():
    out = _result([5, STOP], [], {"type": "stop", "matched": STOP})
    out["meta_info"].pop("output_token_logprobs")
    g = to_generation(out, return_logprobs=False)
    assert (g.token_ids, g.logprobs) == ([5, STOP], None)
