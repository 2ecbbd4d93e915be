"""The policy's own text and its tools cannot crash or stall a rank, and a non-finite reward never
reaches training: bounded tool-call parsing, a calculator that refuses huge results before computing
them, tool replies made valid UTF-8, a bounded pool for hanging tools, and NaN/inf rewards refused
where they enter (tools, harnesses, reward functions, reward models, the score, the config)."""

from __future__ import annotations

import ast
import logging
import math
import threading
import time

import pytest
import torch

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.checks import validate
from megatron_rl.config.rollout_sections import MultiTurnConfig
from megatron_rl.errors import LaunchError, NonFiniteRewardError
from megatron_rl.reward import scoring
from megatron_rl.reward.model import ModelReward
from megatron_rl.reward.rules import RewardManager, RewardOutput
from megatron_rl.reward.source import RewardSource
from megatron_rl.rollout.agent import tools as tl
from megatron_rl.rollout.agent.agent_function import agent_reward
from megatron_rl.rollout.agent.agent_loop import AgentLoop, EpisodeStats, ToolPool, ToolRefused, clean_text
from megatron_rl.rollout.agent.tool_formats import (
    MAX_CALL_CHARS,
    MAX_DEPTH,
    MAX_NUMBER_DIGITS,
    parse_tool_calls,
)
from megatron_rl.rollout.agent.tools import ToolResponse
from megatron_rl.rollout.base import Generation, SamplingParams
from tests.conftest import single_ps
from tests.unit.test_multi_turn import CALL, LookupWithHooks, ScriptedEngine, call_then_answer, items_for


@pytest.fixture(scope="module")
def tok():
    from megatron_rl.demo import tools_task

    return tools_task.build_tools_tokenizer()


def run_loop(tok, tool, values, budget=40, on_messages=None, encode=None):
    """test_multi_turn's scripted episodes (call the tool, then answer), with the messages appended
    after each turn handed to ``on_messages`` and, optionally, the encoder replaced by ``encode``."""
    mt = MultiTurnConfig(enable=True, max_assistant_turns=2, max_user_turns=1, tool_timeout_s=5)
    loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": tool})
    real = encode or loop.encoder.encode

    def spy(messages, last):
        if on_messages is not None:
            on_messages(messages)
        return real(messages, last)

    loop.encoder.encode = spy
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids(CALL)}
    params = SamplingParams(n=1, max_new_tokens=budget, stop_token_ids=sorted(stop), return_logprobs=True)
    items = items_for(values)
    try:
        engine = ScriptedEngine(call_then_answer(tok), stop)
        return loop.run(engine, [it.prompt_ids for it in items], params, items), engine
    finally:
        loop.shutdown()


# --------------------------------------------------------------------------------------------------
# 1. Tool-call text is bounded before it is decoded
# --------------------------------------------------------------------------------------------------


def _hermes(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


@pytest.mark.parametrize(
    ("text", "fmt", "limit"),
    [
        (_hermes('{"a":' * 1000 + "1" + "}" * 1000), "hermes", f"at most {MAX_DEPTH}"),
        (
            _hermes('{"name": "calc", "arguments": {"x": ' + "9" * 5000 + "}}"),
            "hermes",
            f"{MAX_NUMBER_DIGITS}",
        ),
        (_hermes('{"name": "calc", "arguments": "' + "[" * 1000 + '"}'), "hermes", f"at most {MAX_DEPTH}"),
        (_hermes('{"name": "calc", "arguments": {"x": "' + "y" * MAX_CALL_CHARS + '"}}'), "hermes", "65536"),
        (
            '{"name": "calc", "parameters": ' + "[" * 1000 + "]" * 1000 + "}",
            "llama3_json",
            f"at most {MAX_DEPTH}",
        ),
        ('{"name": "calc", "parameters": {"x": -' + "1" * 5000 + "}}", "llama3_json", f"{MAX_NUMBER_DIGITS}"),
    ],
)
def test_deep_long_or_huge_number_calls_are_errors_naming_the_limit(text, fmt, limit):
    (call,) = parse_tool_calls(text, fmt)
    assert call.error is not None and limit in call.error


def test_calls_within_the_bounds_still_parse():
    nested = '{"a":' * (MAX_DEPTH - 2) + "1" + "}" * (MAX_DEPTH - 2)
    text = _hermes('{"name": "calc", "arguments": {"x": ' + nested + ', "s": "[[[[' + "9" * 2000 + '"}}')
    (call,) = parse_tool_calls(text, "hermes")
    assert call.error is None and call.name == "calc" and call.arguments["s"].endswith("9" * 2000)
    (call,) = parse_tool_calls(_hermes('{"name": "calc", "arguments": {"x": ' + "9" * 300 + "}}"), "hermes")
    assert call.error is None and call.arguments["x"] == int("9" * 300)


# --------------------------------------------------------------------------------------------------
# 2. The calculator refuses a huge result before computing it
# --------------------------------------------------------------------------------------------------


def test_calculator_refuses_huge_powers_before_computing(monkeypatch):
    computed: list[int] = []  # bit lengths of every integer the calculator computed
    ops = dict(tl._OPS)
    for op in (ast.Pow, ast.Mult):

        def record(a, b, f=ops[op]):
            out = f(a, b)
            computed.append(abs(out).bit_length() if isinstance(out, int) else 0)
            return out

        ops[op] = record
    monkeypatch.setattr(tl, "_OPS", ops)
    for expr in ("(((9**64)**64)**64)**64", "(2**64)**64", "(10**60)*(10**60)*(10**60)**20", "9**64**64"):
        with pytest.raises(ValueError, match=f"limit|{tl.MAX_EXPONENT}"):
            tl.safe_arithmetic(expr)
    assert max(computed) <= tl.MAX_RESULT_BITS  # nothing past the limit was ever computed
    with pytest.raises(ValueError, match=f"{tl.MAX_RESULT_BITS} bits"):
        tl.safe_arithmetic("(((9**64)**64)**64)**64")
    with pytest.raises(ValueError, match="not a real number"):
        tl.safe_arithmetic("(-8)**0.5")
    assert tl.safe_arithmetic("2**64") == 2**64 and tl.safe_arithmetic("(3 + 4) * 12") == 84
    assert tl.safe_arithmetic("2**-3") == 0.125


def test_calculator_tool_answers_a_huge_power_with_an_error(tok):
    class Calc(tl.CalculatorTool):
        def __init__(self):
            super().__init__({}, {"type": "function", "function": {"name": "lookup", "description": "d"}})

        async def execute(self, instance_id, parameters, **kwargs):
            return await super().execute(instance_id, {"expression": "(((9**64)**64)**64)**64"})

    seen = []
    gens, _ = run_loop(tok, Calc(), ["7"], on_messages=seen.append)
    assert gens[0][0].info["tool_errors"] == 1
    assert "Error: tool 'lookup': ValueError: the result would have about" in seen[0][0]["content"]


# --------------------------------------------------------------------------------------------------
# 3. Tool replies are valid UTF-8; failures are messages naming the tool
# --------------------------------------------------------------------------------------------------


class SurrogateTool(LookupWithHooks):
    def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="a\ud800b"), 0.0, {}


def test_a_lone_surrogate_in_a_tool_reply_is_replaced_not_a_crash(tok):
    assert clean_text("a\ud800b") == "a\ufffdb" and clean_text("plain é") == "plain é"
    seen = []
    gens, _ = run_loop(tok, SurrogateTool(), ["7"], on_messages=seen.append)
    g = gens[0][0]
    assert g.info["tool_calls"] == 1 and g.info["tool_errors"] == 0 and g.finish_reason == "stop"
    assert seen[0][0]["content"] == "a\ufffdb"


def test_a_failing_tool_is_a_message_naming_the_tool_and_a_log_naming_the_row(tok, caplog):
    seen = []
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.agent.agent_loop"):
        gens, _ = run_loop(tok, LookupWithHooks("raise"), ["7"], on_messages=seen.append)
    assert gens[0][0].info["tool_errors"] == 1
    assert seen[0][0]["content"] == "Error: tool 'lookup': RuntimeError: the backend is down"
    assert any(
        "'lookup'" in r.getMessage() and "prompt row 0, sample 0" in r.getMessage() for r in caplog.records
    )


def test_a_reply_the_chat_template_cannot_render_becomes_an_error_message(tok):
    seen = []
    real = []

    def picky(messages, last):
        seen.append(messages)
        if "boom" in messages[0]["content"]:
            raise TypeError("the template refuses it")
        real.append(messages)
        return [1, 2]

    class Boom(LookupWithHooks):
        def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="boom"), 0.0, {}

    gens, _ = run_loop(tok, Boom(), ["7"], encode=picky)
    assert gens[0][0].info["tool_calls"] == 1
    assert real[0][0]["content"].startswith("Error: the reply could not be rendered by the chat template")


# --------------------------------------------------------------------------------------------------
# 4. Hanging tools: a bounded pool, refused calls, a metric
# --------------------------------------------------------------------------------------------------


def test_the_pool_holds_at_most_workers_plus_the_cap_however_many_calls_hang():
    release = threading.Event()
    pool = ToolPool(2, max_abandoned=3)
    futs = [pool.submit(release.wait) for _ in range(50)]
    # abandon every job that runs, as its timeout would, until none is left waiting
    while not all(f.done() or getattr(f, "abandoned", False) for f in futs):
        for f in futs:
            if f.running():
                pool.abandon(f)
            elif not f.done():
                pool.refuse_queued(f)
        assert pool.threads <= 5
        time.sleep(0.001)
    assert pool.abandoned == 5 and pool.live == 0 and pool.threads == 5
    assert sum(f.cancelled() for f in futs) == 45  # refused, never started
    more = pool.submit(release.wait)
    assert isinstance(more.exception(timeout=0), ToolRefused)
    assert "max_abandoned_tool_calls=3" in str(more.exception())
    release.set()
    while pool.abandoned:  # the hung calls return ...
        time.sleep(0.001)
    assert pool.threads == 2  # ... and the pool is back to its workers, and works
    assert pool.submit(lambda: 7).result(timeout=30) == 7
    pool.shutdown()


def test_many_calls_to_a_hanging_tool_keep_the_thread_count_bounded(tok):
    release = threading.Event()

    class Hanging(LookupWithHooks):
        def execute(self, instance_id, parameters, **kwargs):
            release.wait()
            return ToolResponse(text="1"), 0.0, {}

    mt = MultiTurnConfig(
        enable=True,
        max_assistant_turns=2,
        max_user_turns=1,
        tool_timeout_s=0.05,
        tool_workers=2,
        max_abandoned_tool_calls=3,
    )
    others = set(threading.enumerate())  # threads of earlier tests' pools are not this loop's
    loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": Hanging()})
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids(CALL)}
    params = SamplingParams(n=2, max_new_tokens=40, stop_token_ids=sorted(stop))
    items = items_for(["1", "2", "3", "4"])
    before = threading.active_count()
    stats = EpisodeStats()
    try:
        for _ in range(6):  # 6 steps of 8 calls that all hang
            engine = ScriptedEngine(call_then_answer(tok), stop)
            gens = loop.run(engine, [it.prompt_ids for it in items], params, items)
            stats.add(gens)
            assert threading.active_count() - before <= 3  # 2 workers + 3 abandoned, 2 already counted
            assert loop._pool.threads <= 5
        infos = [g.info for per in gens for g in per]
        assert all(i["tool_calls"] == 1 for i in infos)
        assert all(i["tool_errors"] == 1 for i in infos)  # the last step's calls were all refused at once
        metrics = stats.pop(single_ps())
        assert 3 <= metrics["multi_turn/abandoned_tool_calls"] <= 5
    finally:
        release.set()
        loop.shutdown()
    for t in [t for t in threading.enumerate() if t.name == "tool" and t not in others]:
        t.join(timeout=30)
    assert threading.active_count() <= before - 2  # the loop's own workers are gone too


# --------------------------------------------------------------------------------------------------
# 5. Non-finite rewards are refused where they enter
# --------------------------------------------------------------------------------------------------


class RewardTool(LookupWithHooks):
    """Rewards 0.25 per call and 1.0 at the end, except on the row whose value is "3"."""

    def __init__(self, step=0.25, final=1.0):
        super().__init__()
        self.step, self.final = step, final

    def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="1"), self.step if self.values[instance_id] == "3" else 0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        return self.final if self.values[instance_id] == "3" else 1.0


@pytest.mark.parametrize(
    ("tool", "what"),
    [
        (RewardTool(step=math.nan), "its step reward"),
        (RewardTool(step="lots"), "its step reward"),
        (RewardTool(final=math.inf), "its calc_reward"),
    ],
)
def test_a_non_finite_tool_reward_stops_the_rollout_naming_the_tool_and_row(tok, tool, what):
    with pytest.raises(LaunchError, match=rf"tool 'lookup' \({what}\) on prompt row 1, sample 0") as e:
        run_loop(tok, tool, ["7", "3"])
    assert "multi_turn.tool_config_path" in str(e.value) and "\n" not in str(e.value)


def test_a_harness_reward_must_be_finite_or_none():
    assert agent_reward(None) is None and agent_reward(2) == 2.0
    for bad in (math.nan, math.inf, "high"):
        with pytest.raises(ValueError, match="tool_reward_weight"):
            agent_reward(bad)


def _nan_on_second(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan if ground_truth == "3" else 1.0


def test_a_reward_function_returning_nan_stops_the_run_naming_the_row(tok):
    rm = RewardManager(tok, compute_score=_nan_on_second)
    ids = [tok.encode("1", add_special_tokens=False)] * 2
    with pytest.raises(NonFiniteRewardError) as e:
        rm(ids, ["a", "a"], ["7", "3"], [None, None], uids=["u-0", "u-1"])
    msg = str(e.value)
    assert "reward function returned nan" in msg and "_nan_on_second" in msg
    assert "sample 1" in msg and "'u-1'" in msg and "custom_reward_function.path" in msg


def _batch(tok, tool_rewards: list[float]) -> RolloutBatch:
    items = items_for(["7"] * len(tool_rewards))
    gens = [
        [Generation([5, tok.eos_token_id], None, "stop", [1, 1], {"tool_reward": r, "num_turns": 2})]
        for r in tool_rewards
    ]
    return RolloutBatch.from_generations(items, gens, 0, 4, "u-")


class Fixed(RewardSource):
    def __init__(self, scores):
        self.scores = scores

    @property
    def name(self):
        return "fixed scores"

    def score_batch(self, batch, response_lengths):
        return RewardOutput(torch.tensor(self.scores), {}, 0)


def test_the_score_is_checked_finite_before_training(tok):
    cfg = load_config(
        overrides=[
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.rollout.multi_turn.tool_reward_weight=0.5",
        ]
    )
    scores, _ = scoring.reward_scores(Fixed([1.0, 0.0]), _batch(tok, [1.0, 2.0]), single_ps(), cfg)
    assert scores.tolist() == [1.5, 1.0]
    with pytest.raises(NonFiniteRewardError, match=r"row 1 \(uid 'u-1'"):
        scoring.reward_scores(Fixed([1.0, math.nan]), _batch(tok, [0.0, 0.0]), single_ps(), cfg)
    with pytest.raises(NonFiniteRewardError, match="tool reward is inf for row 0"):
        scoring.reward_scores(Fixed([1.0, 1.0]), _batch(tok, [math.inf, 0.0]), single_ps(), cfg)
    big = load_config(
        overrides=[
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.rollout.multi_turn.tool_reward_weight=1e30",
        ]
    )
    with pytest.raises(NonFiniteRewardError, match="tool_reward_weight"):
        scoring.reward_scores(Fixed([1.0, 0.0]), _batch(tok, [1e10, 0.0]), single_ps(), big)


def test_a_reward_model_scoring_nan_stops_the_run_naming_the_row(tok):
    class NanModel(ModelReward):
        def __call__(self, batch):
            return torch.tensor([0.5, math.nan])

    rm = NanModel(None, single_ps(), 1, tok)
    with pytest.raises(NonFiniteRewardError, match=r"row 1 \(uid 'u-1'\) nan.*reward_model.model.path"):
        rm.score_batch(_batch(tok, [0.0, 0.0]), torch.tensor([2, 2]))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_weight_is_refused_at_validation(value):
    key = "actor_rollout_ref.rollout.multi_turn.tool_reward_weight"
    cfg = load_config(overrides=["actor_rollout_ref.model.path=/m", f"{key}={value}"])
    with pytest.raises(ConfigError, match=f"{key}=.*not a finite number"):
        validate(cfg, 1, {})
