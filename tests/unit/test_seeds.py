"""Sampling seeds: one hash of (seed, step, dp_rank, row, validate) per response, and the transformers
engine drawing each row from exactly that seed (reproducible, batch-size independent)."""

import itertools
from dataclasses import replace

import pytest
import torch

from megatron_rl.rollout.base import SGLANG_SEED_BITS, SamplingParams, sample_seed
from tests.conftest import single_ps


def strided_seed(seed: int, step: int, dp_rank: int, row: int, validate: bool) -> int:
    """The former scheme: the trainer's seed*1_000_003 + step*1009 (+7 for validation), plus the DP rank
    and the row added by the engines."""
    return seed * 1_000_003 + step * 1009 + (7 if validate else 0) + dp_rank + row


# steps x DP ranks (past 8) x rows (past 1009) x validate: the places the strided scheme collides
GRID = list(itertools.product(range(40), range(12), range(1100), (False, True)))


def test_no_two_rows_of_a_realistic_grid_share_a_seed():
    seeds = [sample_seed(7, step, dp, row, val) for step, dp, row, val in GRID]
    assert len(set(seeds)) == len(GRID)
    assert all(0 <= s < 2**63 for s in seeds)


def test_the_strided_scheme_collides_on_the_same_grid():  # negative control of the test above
    seeds = [strided_seed(7, step, dp, row, val) for step, dp, row, val in GRID]
    assert len(set(seeds)) < len(GRID) // 10
    assert strided_seed(7, 0, 0, 1009, False) == strided_seed(7, 1, 0, 0, False)  # row 1009 = next step
    assert strided_seed(7, 3, 7, 0, False) == strided_seed(7, 3, 0, 0, True)  # DP 7 = validation
    assert sample_seed(7, 0, 0, 1009, False) != sample_seed(7, 1, 0, 0, False)
    assert sample_seed(7, 3, 7, 0, False) != sample_seed(7, 3, 0, 0, True)


def test_seeds_fit_what_the_engines_take():
    big = [sample_seed(s, 10**6, 255, 10**5, True) for s in (0, -1, 2**70, 12345)]
    for s in big:
        torch.Generator().manual_seed(s)  # int64 range
    small = [sample_seed(7, step, dp, row, False, SGLANG_SEED_BITS) for step, dp, row, _ in GRID[:20000]]
    assert all(0 <= s < 2**31 for s in small)
    torch.tensor(small, dtype=torch.int32)  # SGLang batches sampling_seed as int32
    with pytest.raises(ValueError, match="bits"):
        sample_seed(0, 0, 0, 0, False, bits=64)
    assert sample_seed(1, 2, 3, 4, False) == sample_seed(1, 2, 3, 4, False)  # a pure function
    assert len({sample_seed(s, 0, 0, 0, False) for s in range(100)}) == 100


@pytest.fixture(scope="module")
def tiny():
    from megatron_rl.model_args import model_args_from_hf_config
    from megatron_rl.models.random_hf import random_hf_model

    dims = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)  # fmt: skip
    model = random_hf_model("llama", seed=3, init="o1", **dims).eval()
    args = model_args_from_hf_config({**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    return model, args


def engine_for(tiny, dp_rank: int = 0, max_batch_size: int = 64):
    from megatron_rl.rollout.hf_engine import HFEngine

    model, args = tiny
    engine = HFEngine(args, single_ps(dp_rank), max_batch_size=max_batch_size)
    engine.update_weights([list(model.state_dict().items())])
    return engine


PROMPTS = [[4, 5, 6], [7], [8, 9]]
PARAMS = SamplingParams(n=3, temperature=1.3, max_new_tokens=6, seed=11, step=5, return_logprobs=True)


def tokens(gens) -> list[list[int]]:
    return [g.token_ids for per_prompt in gens for g in per_prompt]


def test_each_row_draws_from_its_sample_seed(tiny):
    model, _ = tiny
    for dp in (0, 3):
        got = tokens(engine_for(tiny, dp).generate(PROMPTS, PARAMS))
        # oracle: the first token of row i*n+j is one multinomial draw from the model's next-token
        # distribution with a generator seeded by sample_seed(seed, step, dp, row, validate)
        rows = [p for p in PROMPTS for _ in range(PARAMS.n)]
        for r, (prompt, toks) in enumerate(zip(rows, got, strict=True)):
            with torch.no_grad():
                logits = model(torch.tensor([prompt])).logits[0, -1].float()
            g = torch.Generator().manual_seed(sample_seed(11, 5, dp, r, False))
            want = torch.multinomial(torch.softmax(logits / PARAMS.temperature, -1), 1, generator=g).item()
            assert toks[0] == want, (dp, r)


def test_same_seed_same_rollouts_and_every_key_changes_them(tiny):
    first = tokens(engine_for(tiny).generate(PROMPTS, PARAMS))
    assert tokens(engine_for(tiny).generate(PROMPTS, PARAMS)) == first  # a fresh engine: a resumed run
    assert tokens(engine_for(tiny, max_batch_size=2).generate(PROMPTS, PARAMS)) == first  # batch-independent
    others = [
        replace(PARAMS, step=6),
        replace(PARAMS, validate=True),
        replace(PARAMS, seed=12),
    ]
    for p in others:
        assert tokens(engine_for(tiny).generate(PROMPTS, p)) != first, p
    assert tokens(engine_for(tiny, dp_rank=1).generate(PROMPTS, PARAMS)) != first
    # the n samples of one prompt come from distinct streams
    assert len({tuple(t) for t in first[:3]}) > 1


def test_rollout_seed_seeds_the_sampling_and_data_seed_does_not():
    from megatron_rl.config import load_config, resolve
    from megatron_rl.roles.rollout import sampling_params

    def seed_of(*overrides: str, validate: bool = False) -> int | None:
        cfg = load_config("yaml/cpu_demo.yaml", list(overrides))
        spec = resolve(cfg, "cpu").rollout
        return sampling_params(cfg.actor_rollout_ref.rollout, spec, [2], 3, validate, logprobs=True).seed

    assert seed_of() == 0  # verl's default
    assert (
        seed_of("actor_rollout_ref.rollout.seed=5")
        == seed_of("actor_rollout_ref.rollout.seed=5", validate=True)
        == 5
    )
    assert seed_of("data.seed=5") == seed_of("actor_rollout_ref.actor.megatron.seed=5") == 0


def test_streams_and_keys_never_share_a_seed():
    from megatron_rl import seeds

    streams = [seeds.SAMPLE, seeds.ENGINE_CALL, seeds.DATA_ORDER, seeds.UPDATE_ORDER,
               seeds.CLIP_COV, seeds.ROUNDING, seeds.LORA_INIT]  # fmt: skip
    assert len(set(streams)) == len(streams)
    same_key = {seeds.derive(s, 7, 3) for s in streams}
    assert len(same_key) == len(streams)  # equal keys, other streams: other seeds
    # parts are length-prefixed and typed: neither concatenation nor str-vs-int collides
    assert seeds.derive(seeds.LORA_INIT, 1, "ab", "c") != seeds.derive(seeds.LORA_INIT, 1, "a", "bc")
    assert seeds.derive(seeds.ROUNDING, 1, "7") != seeds.derive(seeds.ROUNDING, 1, 7)
    assert seeds.derive(seeds.UPDATE_ORDER, 1, 2) != seeds.derive(seeds.UPDATE_ORDER, 2, 1)
    assert seeds.derive(seeds.DATA_ORDER, -1, 0) == seeds.derive(seeds.DATA_ORDER, 2**64 - 1, 0)  # mod 2**64
    # the actor's and the critic's optimizers (same job seed) round with different noise
    assert seeds.derive(seeds.ROUNDING, 42, "actor_rollout_ref.actor.optim", 5) != seeds.derive(
        seeds.ROUNDING, 42, "critic.optim", 5
    )


def test_every_stream_of_the_package_comes_from_the_seeds_module():
    """A generator seeded in the package takes a name (a seed derived by megatron_rl.seeds, handed in)
    or seeds.derive itself; no module keeps a formula of its own. The owners' streams stay theirs:
    megatron's model-parallel RNG (cpu_bridge, parallel.seed_all), verl's bootstrap draws (numpy, 42),
    the random test models and the demo's data generators."""
    import pathlib
    import re

    import megatron_rl

    root = pathlib.Path(megatron_rl.__file__).parent
    owners = {"cpu_bridge.py", "parallel.py", "models/random_hf.py", "demo/toy.py", "demo/tools_task.py",
              "reward/scoring.py"}  # fmt: skip
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in owners:
            continue
        for arg in seeded_args(path.read_text()):
            if not (re.fullmatch(r"[A-Za-z_][\w.]*", arg) or arg.startswith("seeds.derive(")):
                found.append(f"{rel}: {arg}")
    assert not found, "seed formulas outside megatron_rl.seeds: " + "; ".join(found)


def seeded_args(text: str) -> list[str]:
    """The argument of every manual_seed( / RandomState( / random.Random( call in ``text`` (balanced)."""
    import re

    out = []
    for m in re.finditer(r"(?:manual_seed|RandomState|random\.Random)\(", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        out.append(" ".join(text[m.end() : i - 1].split()))
    return out


def test_the_seed_scan_sees_a_formula():  # negative control of the test above
    old = (
        "torch.Generator(device=d).manual_seed(\n    (self.seed * 1_000_003 + self.num_steps) % (1 << 63)\n)"
    )
    assert seeded_args(old) == ["(self.seed * 1_000_003 + self.num_steps) % (1 << 63)"]
    assert seeded_args("g.manual_seed(seeds.derive(seeds.CLIP_COV, s, r))") == [
        "seeds.derive(seeds.CLIP_COV, s, r)"
    ]
