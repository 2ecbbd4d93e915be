"""RolloutBatch.routed_experts follows input_ids through assembly, compaction, selection and
concatenation (positions checked by hand), and SGLang's base64 routing decodes to [tokens, L, k]."""

import base64

import numpy as np
import pytest
import torch

from megatron_rl.batch import RolloutBatch
from megatron_rl.data import PromptItem
from megatron_rl.rollout.base import Generation
from megatron_rl.rollout.sglang_outputs import routed_experts

L, K = 2, 2


def _gen(tokens: list[int], prompt_len: int, tag: int) -> Generation:
    n = prompt_len + len(tokens) - 1  # every token the engine read
    # expert id = tag * 100 + position in the sequence (layer 0), + 50 in layer 1
    ids = torch.arange(n)[:, None, None] + tag * 100 + torch.tensor([0, 50])[None, :, None]
    return Generation(tokens, None, "stop", routed_experts=ids.expand(n, L, K).to(torch.int16).clone())


def _batch(prompts: list[list[int]], responses: list[list[int]], tag0: int = 0) -> RolloutBatch:
    items = [PromptItem(p, "toy", None, index=i) for i, p in enumerate(prompts)]
    gens = [[_gen(r, len(p), tag0 + i)] for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
    return RolloutBatch.from_generations(items, gens, 0, 8, "u")


def _expected(prompt_len: int, resp_len: int, tag: int) -> torch.Tensor:
    return torch.arange(prompt_len + resp_len - 1) + tag * 100  # layer 0, first expert


def test_positions_follow_input_ids_through_compaction_and_concat():
    b = _batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]])
    re = b.routed_experts  # [2, P=3 + R=3, L, K]
    assert re.shape == (2, 6, L, K) and re.dtype == torch.int16
    # row 1: prompt left padded by 2, then 1 prompt + 3 response tokens, of which the last is unread
    assert re[1, :2].eq(-1).all() and re[1, 5].eq(-1).all()
    assert re[1, 2:5, 0, 0].tolist() == _expected(1, 3, 1).tolist()
    assert re[1, 2:5, 1, 1].tolist() == (_expected(1, 3, 1) + 50).tolist()
    # row 0: 3 prompt + 2 response tokens, the last unread, then right padding
    assert re[0, :4, 0, 0].tolist() == _expected(3, 2, 0).tolist() and re[0, 4:].eq(-1).all()

    c = b.compacted()  # every row's real tokens at the front
    assert c.routed_experts[1, :3, 0, 0].tolist() == _expected(1, 3, 1).tolist()
    assert c.routed_experts[1, 3:].eq(-1).all()
    assert torch.equal(b.select([1]).routed_experts, re[1:])

    other = _batch([[1, 2, 3, 4]], [[5]], tag0=7)  # a longer prompt, a shorter response
    cat = RolloutBatch.concat([b, other], pad_id=0)
    assert cat.routed_experts.shape == (3, 4 + 3, L, K)
    # each row's routing sits where its input_ids are
    for row, (src, idx) in enumerate([(b, 0), (b, 1), (other, 0)]):
        real = cat.attention_mask[row].bool()
        src_real = src.attention_mask[idx].bool()
        assert torch.equal(cat.routed_experts[row][real], src.routed_experts[idx][src_real])
        assert cat.routed_experts[row][~real].eq(-1).all()


def test_sglang_routing_decodes_and_a_missing_one_is_an_error():
    ids = np.arange(3 * L * K, dtype=np.int32)
    out = {"meta_info": {"routed_experts": base64.b64encode(ids.tobytes()).decode()}}
    got = routed_experts(out, L, K)
    assert got.shape == (3, L, K) and got.dtype == torch.int16 and got.flatten().tolist() == ids.tolist()
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        routed_experts({"meta_info": {}}, L, K)
    with pytest.raises(RuntimeError, match="not a multiple"):
        routed_experts({"meta_info": {"routed_experts": base64.b64encode(ids[:5].tobytes()).decode()}}, L, K)
