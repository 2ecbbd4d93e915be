"""Multi-turn episodes' model turns on the in-process SGLang engine (rollout/episode_engine.py
SGLangTurns): every turn its own ``async_generate`` request on SGLang's event loop, awaited by one
coroutine per episode.

Oracles: the greedy turns, submitted at different times by concurrent episodes, are judged against
transformers on the same weights as test_sglang.py judges ``generate``; a second turn that extends the
first one's context finds it in SGLang's prefix cache (``cached_tokens``). On the H200 (2026-12-04):
98.4% / 97.9% of the first / second turns' tokens the argmax (worst gap 0.009 / 0.012 logits), and
368 tokens read from the cache, of the 384 context tokens the second turns sent (576 in all).

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu/test_sglang_turns.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.gpu.test_sglang import DIMS, assert_greedy_ok, judge

pytestmark = pytest.mark.gpu
NEW = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_rl.config import RolloutConfig
    from megatron_rl.model_args import load_model_args
    from megatron_rl.models.builder import build_model, load_hf_weights
    from megatron_rl.models.random_hf import save_random_hf_model
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import create_engine
    from megatron_rl.rollout.reshard import sync_weights

    path = save_random_hf_model(str(tmp_path_factory.mktemp("m") / "a"), "llama", seed=1, **DIMS)
    ps = init_parallel(1, 1, device="cuda")
    args = load_model_args(path)
    model = build_model(args, ps, dtype=torch.bfloat16)
    load_hf_weights(model, path, ps)
    cfg = RolloutConfig(name="sglang", dtype="bfloat16", gpu_memory_utilization=0.3, enable_cuda_graph=False)
    eng = create_engine(cfg, path, args, ps, seed=0)
    sync_weights(model, ps, eng, bucket_megabytes=1.0, dtype=torch.bfloat16)
    yield path, eng
    eng.shutdown()
    destroy_parallel()


def _episodes(server, prompts, params, delays):
    """One coroutine per prompt: wait its delay (a tool), then one turn; then a second turn on the
    first one's context. Returns the first and second turns' generations."""

    async def episode(i: int):
        await asyncio.sleep(delays[i])
        first = await server.turn(prompts[i], params, (0, i))
        second = await server.turn(prompts[i] + first.token_ids, params, (0, i + len(prompts)))
        server.leave()
        return first, second

    async def main():
        return await asyncio.gather(*(episode(i) for i in range(len(prompts))))

    return server.run(main())


def test_concurrent_turns_are_the_models_and_reuse_the_prefix_cache(engine):
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.episode_engine import turn_server

    path, eng = engine
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, DIMS["vocab_size"], (16, 12), generator=g).tolist()
    server = turn_server(eng)
    out = _episodes(
        server, prompts, SamplingParams(greedy=True, max_new_tokens=NEW), [0.01 * (i % 4) for i in range(16)]
    )
    firsts = [f.token_ids for f, _ in out]
    assert all(len(t) == NEW for t in firsts)
    assert_greedy_ok(judge(path, prompts, firsts))
    # second turns extend the first: judged on the whole context
    contexts = [p + f for p, f in zip(prompts, firsts, strict=True)]
    assert_greedy_ok(judge(path, contexts, [s.token_ids for _, s in out]))
    st = server.stats
    assert st.turns == 32 and st.cache_reported
    assert st.cached_tokens >= 16 * 12, st  # every second turn found at least its prompt cached
    print(f"SGLang turns: {st}")
