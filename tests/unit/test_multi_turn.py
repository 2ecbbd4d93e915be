"""The multi-turn agent loop: tool-call parsing, verl's config files, tools run concurrently with
timeouts and errors as messages, turn and token budgets, token-exact sequences on the transformers
engine (against an independent forward of the same model), and the masks every loss reads."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from megatron_rl.batch import RolloutBatch
from megatron_rl.config import ConfigError
from megatron_rl.config.rollout_sections import MultiTurnConfig
from megatron_rl.data import PromptItem
from megatron_rl.demo import tools_task
from megatron_rl.rollout.agent.agent_loop import AgentLoop, EpisodeStats, TurnEncoder, truncate_text
from megatron_rl.rollout.agent.tool_formats import parse_hermes, parse_llama3_json, parse_tool_calls
from megatron_rl.rollout.agent.tools import BaseTool, ToolResponse, load_interactions, load_tools
from megatron_rl.rollout.base import Generation, SamplingParams
from tests.conftest import single_ps

CALL = tools_task.CALL_TOKEN


@pytest.fixture(scope="module")
def tok():
    return tools_task.build_tools_tokenizer()


# --------------------------------------------------------------------------------------------------
# Parsing and formats
# --------------------------------------------------------------------------------------------------


def test_parse_hermes_calls_and_malformed_ones():
    text = (
        'a <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call> b '
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "x", "arguments": 5}</tool_call>'
    )
    calls = parse_hermes(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calc", {"expression": "1+2"}, True),
        ("calc", {"expression": "3"}, True),  # arguments given as a JSON string
    ]
    assert "not valid JSON" in calls[2].error and '"name"' in calls[3].error
    assert calls[4].name == "x" and "not a JSON object" in calls[4].error
    assert parse_hermes("no call <tool_call> unterminated") == []


def test_parse_llama3_json_calls_answers_and_malformed_ones():
    one = '<|python_tag|>{"name": "calc", "parameters": {"expression": "1+2"}}<|eom_id|>'
    assert [(c.name, c.arguments, c.error) for c in parse_llama3_json(one)] == [
        ("calc", {"expression": "1+2"}, None)
    ]
    two = '{"name": "a", "parameters": {}}; {"name": "b", "arguments": "{\\"x\\": 1}"}<|eot_id|>'
    assert [(c.name, c.arguments) for c in parse_llama3_json(two)] == [("a", {}), ("b", {"x": 1})]
    assert parse_llama3_json("The answer is 3.<|eot_id|>") == []  # an answer, not a call
    assert "not valid JSON" in parse_llama3_json('{"name": "a", "parameters": {')[0].error
    assert '"parameters"' in parse_llama3_json('{"tool": "a"}')[0].error
    assert "not a JSON object" in parse_llama3_json('{"name": "a", "parameters": [1]}')[0].error
    # the same turn read as Hermes has no call, and an unknown format is refused naming the key
    assert parse_tool_calls(one, "hermes") == []
    with pytest.raises(ValueError, match="multi_turn.format='gpt-oss'"):
        parse_tool_calls(one, "gpt-oss")


def test_the_loop_runs_llama3_json_calls():
    from megatron_rl.config.rollout_sections import MultiTurnConfig

    tok = tools_task.build_tools_tokenizer()  # its own: a call token is added to it
    llama_call = '{"name": "lookup", "parameters": {}}'
    tok.add_tokens([llama_call])
    call, close = tok.convert_tokens_to_ids(llama_call), tok.convert_tokens_to_ids(tools_task.REPLY_CLOSE)

    def policy(prefix):
        if close in prefix:
            return [prefix[prefix.index(close) - 1], tok.eos_token_id]
        return [call]

    tool = LookupWithHooks()
    mt = MultiTurnConfig(
        enable=True, max_assistant_turns=2, max_user_turns=1, tool_timeout_s=5, format="llama3_json"
    )
    loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": tool})
    stop = {tok.eos_token_id, call}
    params = SamplingParams(n=1, max_new_tokens=8, stop_token_ids=sorted(stop), return_logprobs=True)
    try:
        gens = loop.run(ScriptedEngine(policy, stop), [[14, 15]], params, items_for(["7"]))
    finally:
        loop.shutdown()
    g = gens[0][0]
    assert g.info["tool_calls"] == 1 and g.info["tool_errors"] == 0
    assert g.token_ids[0] == call and g.token_ids[-2:] == [tok.convert_tokens_to_ids("7"), tok.eos_token_id]
    assert g.response_mask[0] == 1 and g.response_mask[1] == 0 and g.response_mask[-2:] == [1, 1]


def test_a_turn_cap_ends_the_turn_not_the_episode(tok):
    from megatron_rl.config.rollout_sections import MultiTurnConfig

    word = tok.convert_tokens_to_ids("7")
    for cap, want_len, want_finish in ((None, 8, "length"), (3, 3, "stop")):
        mt = MultiTurnConfig(enable=True, max_assistant_turns=2, max_tokens_per_turn=cap)
        loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": LookupWithHooks()})
        engine = ScriptedEngine(lambda prefix: [word] * 20, {tok.eos_token_id})
        params = SamplingParams(n=1, max_new_tokens=8, stop_token_ids=[tok.eos_token_id])
        try:
            ((g,),) = loop.run(engine, [[14, 15]], params, items_for(["7"]))
        finally:
            loop.shutdown()
        # no call in the turn: with the cap the episode ends as if the model had stopped
        assert (len(g.token_ids), g.finish_reason) == (want_len, want_finish), cap


def test_truncate_sides():
    assert truncate_text("abcdefghij", 20, "middle") == "abcdefghij"
    assert truncate_text("abcdefghij", 4, "left") == "abcd...(truncated)"
    assert truncate_text("abcdefghij", 4, "right") == "(truncated)...ghij"
    assert truncate_text("abcdefghij", 4, "middle") == "ab...(truncated)...ij"


VERL_GSM8K_TOOL_CONFIG = """tools:
  - class_name: "{cls}"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_verl_tool_config_loads_unchanged(tmp_path):
    path = tmp_path / "tool_config.yaml"
    path.write_text(VERL_GSM8K_TOOL_CONFIG.format(cls="megatron_rl.rollout.agent.tools.CalculatorTool"))
    tools = load_tools(str(path))
    assert list(tools) == ["calc_gsm8k_reward"]  # the schema's name is the name the model calls
    tool = tools["calc_gsm8k_reward"]
    assert tool.tool_schema["function"]["parameters"]["required"] == ["answer"]
    iid, _ = asyncio.run(tool.create())
    resp, reward, _ = asyncio.run(tool.execute(iid, {"expression": "(3 + 4) * 12"}))
    assert resp.text == "84" and reward == 0.0
    # a config written before the tools moved to rollout/agent/ names the same class
    path.write_text(VERL_GSM8K_TOOL_CONFIG.format(cls="megatron_rl.rollout.tools.CalculatorTool"))
    assert type(load_tools(str(path))["calc_gsm8k_reward"]) is type(tool)
    # verl's own class: a one-line error naming the file and the class when verl is not installed
    path.write_text(VERL_GSM8K_TOOL_CONFIG.format(cls="verl.tools.gsm8k_tool.Gsm8kTool"))
    try:
        import verl  # noqa: F401
    except ImportError:
        with pytest.raises(
            ConfigError, match=r"tool_config.yaml: tools\[0\]: class_name='verl.tools.gsm8k_tool"
        ):
            load_tools(str(path))
    calculator = "megatron_rl.rollout.agent.tools.CalculatorTool"
    path.write_text(VERL_GSM8K_TOOL_CONFIG.format(cls=calculator).replace("native", "mcp"))
    with pytest.raises(ConfigError, match="only native tools"):
        load_tools(str(path))
    with pytest.raises(ConfigError, match="multi_turn.tool_config_path='/nope.yaml': no such file"):
        load_tools("/nope.yaml")


def test_verl_interaction_config_loads(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(
        'interaction:\n  - name: "gsm8k"\n'
        '    class_name: "megatron_rl.rollout.agent.tools.AnswerCheckInteraction"\n'
        "    config: {}\n"
    )
    inter = load_interactions(str(path))["gsm8k"]
    assert inter.name == "gsm8k"
    done, text, score, _ = asyncio.run(
        inter.generate_response("i", [{"role": "assistant", "content": "it is 42"}], ground_truth="42")
    )
    assert (done, text, score) == (True, "correct", 1.0)


def test_multi_turn_keys_load_under_verl_names(tmp_path):
    from megatron_rl.config import load_config

    notices: list[str] = []
    cfg = load_config(
        overrides=[
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=t.yaml",
            "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=false",
            "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=strict",
        ],
        notices=notices,
    )
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_user_turns, mt.tool_config_path) == (
        True,
        3,
        2,
        "t.yaml",
    )
    assert any("tokenization_sanity_check_mode" in n and "never re-tokenised" in n for n in notices)
    with pytest.raises(ValueError, match="use_inference_chat_template=True"):
        load_config(overrides=["actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true"])


def test_multi_turn_checks_name_the_key():
    from megatron_rl.config import load_config
    from megatron_rl.config.checks import validate

    base = ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.multi_turn.enable=true"]
    validate(load_config(overrides=base), world_size=1, model_dims={})
    for bad, key in (
        ("format=gpt-oss", "multi_turn.format='gpt-oss'"),
        ("max_assistant_turns=0", "multi_turn.max_assistant_turns"),
        ("tool_timeout_s=0", "multi_turn.tool_timeout_s"),
    ):
        with pytest.raises(ConfigError, match=key):
            validate(load_config(overrides=[*base, f"actor_rollout_ref.rollout.multi_turn.{bad}"]), 1, {})


# --------------------------------------------------------------------------------------------------
# The loop on a scripted policy (an engine whose next turn is a function of the tokens it is given)
# --------------------------------------------------------------------------------------------------


class ScriptedEngine:
    """A RolloutEngine whose turn is ``policy(prefix)``; records every prefix it was given."""

    def __init__(self, policy, stop: set[int]):
        self.policy, self.stop, self.seen = policy, stop, []

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            self.seen.append(list(p))
            toks = list(self.policy(p))[: params.max_new_tokens]
            done = bool(toks) and toks[-1] in self.stop
            out.append([Generation(toks, [-0.5] * len(toks), "stop" if done else "length")])
        return out


def items_for(values: list[str]) -> list[PromptItem]:
    return [
        PromptItem(
            prompt_ids=[14, 15],
            data_source=tools_task.TOOLS_DATA_SOURCE,
            ground_truth=v,
            extra_info={"tools_kwargs": {"lookup": {"create_kwargs": {"value": v}}}},
            index=i,
            messages=[{"role": "user", "content": "secret"}],
        )
        for i, v in enumerate(values)
    ]


class LookupWithHooks(BaseTool):
    """The lookup tool, counting its calls; ``mode`` makes it fail, hang or wait for its peers."""

    def __init__(self, mode="ok", barrier=None):
        super().__init__({}, {"type": "function", "function": {"name": "lookup", "description": "d"}})
        self.mode, self.barrier, self.values, self.released = mode, barrier, {}, []

    async def create(self, instance_id=None, **kwargs):
        iid = f"i{len(self.values)}"
        self.values[iid] = kwargs["create_kwargs"]["value"]
        return iid, ToolResponse()

    def execute(self, instance_id, parameters, **kwargs):  # a plain function: blocking tools work too
        if self.mode == "raise":
            raise RuntimeError("the backend is down")
        if self.mode == "hang":
            time.sleep(3)
        if self.barrier is not None:
            self.barrier.wait(timeout=10)  # passes only if every episode's call runs at once
        return ToolResponse(text=self.values[instance_id]), 0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


def call_then_answer(tok):
    call, close = tok.convert_tokens_to_ids(CALL), tok.convert_tokens_to_ids(tools_task.REPLY_CLOSE)

    def policy(prefix):
        if close in prefix:  # answer with the digit inside the tool reply, then EOS
            return [prefix[prefix.index(close) - 1], tok.eos_token_id]
        return [call]

    return policy


def run_loop(tok, tool, values, mt=None, budget=8, n=1):
    mt = mt or MultiTurnConfig(enable=True, max_assistant_turns=2, max_user_turns=1, tool_timeout_s=5)
    loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": tool})
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids(CALL)}
    engine = ScriptedEngine(call_then_answer(tok), stop)
    params = SamplingParams(n=n, max_new_tokens=budget, stop_token_ids=sorted(stop), return_logprobs=True)
    try:
        return loop.run(
            engine, [it.prompt_ids for it in items_for(values)], params, items_for(values)
        ), engine
    finally:
        loop.shutdown()


def test_tool_episode_tokens_masks_and_rewards(tok):
    tool = LookupWithHooks()
    gens, engine = run_loop(tok, tool, ["7", "3"], n=2)
    call = tok.convert_tokens_to_ids(CALL)

    def reply(d):
        return tok.encode(f"{tools_task.REPLY_OPEN} {d} {tools_task.REPLY_CLOSE} =", add_special_tokens=False)

    for value, per_prompt in zip(["7", "3"], gens, strict=True):
        assert len(per_prompt) == 2
        for g in per_prompt:
            d = tok.convert_tokens_to_ids(value)
            assert g.token_ids == [call, *reply(value), d, tok.eos_token_id]
            assert g.response_mask == [1, 0, 0, 0, 0, 1, 1]
            assert g.logprobs[0] == -0.5 and all(math.isnan(x) for x in g.logprobs[1:5])
            assert g.finish_reason == "stop"
            assert g.info["num_turns"] == 4 and g.info["tool_calls"] == 1 and g.info["tool_errors"] == 0
            assert g.info["tool_rewards"] == [0.25] and g.info["reward_scores"] == {"lookup": 1.0}
            assert g.info["tool_reward"] == 1.25
    # the engine's second turns saw exactly prompt + first turn + the tool reply (both samples of "7";
    # in the order their tools returned: each episode submits its turn on its own)
    assert engine.seen[4:].count([14, 15, call, *reply("7")]) == 2
    assert sorted(tool.released) == sorted(tool.values)  # every instance released
    batch = RolloutBatch.from_generations(items_for(["7", "3"]), gens, 0, 8, "s-")
    assert batch.response_mask[0].tolist() == [1, 0, 0, 0, 0, 1, 1]
    assert batch.attention_mask[0, 2:].tolist() == [1] * 7  # the model reads the tool tokens
    assert batch.meta[0].extra_info["rollout_reward_scores"] == {"lookup": 1.0}
    assert batch.meta[0].extra_info["num_turns"] == 4
    assert batch.meta[0].extra_info is not batch.meta[1].extra_info  # per sample, not per prompt
    assert "num_turns" not in items_for(["7"])[0].extra_info
    assert (
        tools_task.compute_score("", tok.decode(batch.responses[0].tolist(), skip_special_tokens=True), "7")[
            "acc"
        ]
        == 1.0
    )


def test_failing_and_hanging_tools_become_messages(tok):
    gens, _ = run_loop(tok, LookupWithHooks("raise"), ["7"], budget=40)
    g = gens[0][0]
    assert g.info["tool_errors"] == 1 and g.info["tool_calls"] == 1
    text = tok.decode(g.token_ids, skip_special_tokens=False)
    assert "<unk>" in text  # "Error: RuntimeError: the backend is down" in the toy's words
    # one worker: the second call runs on the worker that replaces the one stuck in the first
    mt = MultiTurnConfig(
        enable=True, max_assistant_turns=2, max_user_turns=1, tool_timeout_s=0.2, tool_workers=1
    )
    gens, _ = run_loop(tok, LookupWithHooks("hang"), ["7", "3"], mt=mt, budget=40)
    assert [g[0].info["tool_timeouts"] for g in gens] == [1, 1]
    assert all(g[0].token_ids.count(tok.convert_tokens_to_ids(CALL)) == 1 for g in gens)


def test_tools_of_all_episodes_run_at_once(tok):
    barrier = threading.Barrier(6)
    gens, _ = run_loop(tok, LookupWithHooks(barrier=barrier), ["1", "2", "3"], n=2)
    assert all(g.info["tool_errors"] == 0 and g.info["tool_timeouts"] == 0 for per in gens for g in per)


def test_turn_and_token_budgets(tok):
    # one model turn: the call ends the episode before any tool runs
    mt = MultiTurnConfig(enable=True, max_assistant_turns=1)
    gens, _ = run_loop(tok, LookupWithHooks(), ["7"], mt=mt)
    assert gens[0][0].token_ids == [tok.convert_tokens_to_ids(CALL)] and gens[0][0].finish_reason == "stop"
    # no user turns allowed
    mt = MultiTurnConfig(enable=True, max_user_turns=0)
    gens, _ = run_loop(tok, LookupWithHooks(), ["7"], mt=mt)
    assert gens[0][0].info["tool_calls"] == 0
    # the tool reply does not fit in 4 tokens: the episode ends by length, the reply is not appended
    gens, _ = run_loop(tok, LookupWithHooks(), ["7"], budget=4)
    assert gens[0][0].token_ids == [tok.convert_tokens_to_ids(CALL)] and gens[0][0].finish_reason == "length"
    # the answer turn is cut at the budget
    gens, _ = run_loop(tok, LookupWithHooks(), ["7"], budget=6)
    assert len(gens[0][0].token_ids) == 6 and gens[0][0].finish_reason == "length"
    stats = EpisodeStats()
    stats.add(gens)
    m = stats.pop(single_ps())
    assert m["multi_turn/length_ended_ratio"] == 1.0 and m["multi_turn/num_turns/max"] == 4.0
    assert m["multi_turn/tool_calls_per_episode"] == 1.0


def test_interaction_answers_until_correct(tok, tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(
        "interaction:\n  - name: check\n"
        "    class_name: megatron_rl.rollout.agent.tools.AnswerCheckInteraction\n"
        "    config: {retry_text: secret}\n"
    )
    mt = MultiTurnConfig(enable=True, interaction_config_path=str(path), max_assistant_turns=5)
    loop = AgentLoop(mt, single_ps(), tok, tools={})
    d = {v: tok.convert_tokens_to_ids(v) for v in "0123456789"}
    # answers 1, then 2, then 3 ... ending each turn with EOS; the user wants "3"
    policy = lambda p: [d[str(p.count(tok.eos_token_id) + 1)], tok.eos_token_id]  # noqa: E731
    items = items_for(["3"])
    items[0].extra_info["interaction_kwargs"] = {"name": "check", "ground_truth": "3"}
    engine = ScriptedEngine(policy, {tok.eos_token_id})
    params = SamplingParams(max_new_tokens=30, stop_token_ids=[tok.eos_token_id])
    g = loop.run(engine, [items[0].prompt_ids], params, items)[0][0]
    assert g.info["assistant_turns"] == 3 and g.info["turn_scores"] == [0.0, 0.0, 1.0]
    assert g.finish_reason == "stop"
    secret = tok.convert_tokens_to_ids("secret")
    # two retries ("secret =") and the final "correct" (<unk> =), each with response_mask 0
    assert g.token_ids == [5, 2, secret, 15, 6, 2, secret, 15, 7, 2, tok.unk_token_id, 15]
    assert g.response_mask == [1, 1, 0, 0] * 3
    loop.shutdown()


# --------------------------------------------------------------------------------------------------
# Token in, token out on the transformers engine
# --------------------------------------------------------------------------------------------------


def fused_tokenizer():
    """A word-level tokenizer whose decoder glues tokens ("1", "2" -> "12") and whose vocabulary has
    "12" and "21": rendering the conversation as text and encoding it again gives other tokens than
    the engine's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", "1", "2", "12", "21", CALL])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.Fuse()
    backend.add_tokens([AddedToken(CALL, normalized=False, special=False)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


class Digits(BaseTool):
    def __init__(self):
        super().__init__({}, {"type": "function", "function": {"name": "lookup", "description": "d"}})

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="21"), 0.0, {}


def test_training_sequence_is_what_the_engine_saw(tmp_path):
    from megatron_rl.model_args import model_args_from_hf_config
    from megatron_rl.models.random_hf import random_hf_model
    from megatron_rl.rollout.hf_engine import HFEngine

    tok = fused_tokenizer()
    dims = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=64)  # fmt: skip
    oracle = random_hf_model("llama", seed=3, init="o1", **dims).eval()
    args = model_args_from_hf_config({**oracle.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    engine = HFEngine(args, single_ps())
    engine.update_weights([list(oracle.state_dict().items())])
    call = tok.convert_tokens_to_ids(CALL)
    stop = [tok.eos_token_id, call]
    mt = MultiTurnConfig(enable=True, max_assistant_turns=4)
    loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": Digits()})
    prompts = [[4, 5], [6], [5, 4, 4]]
    params = SamplingParams(n=8, max_new_tokens=16, stop_token_ids=stop, return_logprobs=True, seed=11)
    gens = loop.run(engine, prompts, params)
    loop.shutdown()
    tool_turns = differ = 0
    for prompt, per_prompt in zip(prompts, gens, strict=True):
        for g in per_prompt:
            seq = torch.tensor([prompt + g.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(oracle(seq).logits[0, :-1].float(), -1)  # [S-1, V]
            lp = lp[len(prompt) - 1 :].gather(-1, seq[0, len(prompt) :, None])[:, 0]  # [R]
            model = torch.tensor(g.response_mask, dtype=torch.bool)
            # The engine's log-probs on its own tokens equal an independent forward of the assembled
            # sequence: the engine saw exactly these tokens before each of its own.
            torch.testing.assert_close(torch.tensor(g.logprobs)[model], lp[model], atol=1e-4, rtol=0)
            assert all(math.isnan(x) for x in torch.tensor(g.logprobs)[~model].tolist())
            if g.info["tool_calls"]:
                tool_turns += 1
                # the tool reply "21" is the template's rendering, encoded alone: one token
                assert tok.convert_tokens_to_ids("21") in [
                    t for t, m in zip(g.token_ids, g.response_mask, strict=True) if not m
                ]
            # negative control: the conversation rendered as text and encoded again is another sequence
            again = tok.encode(tok.decode(prompt + g.token_ids), add_special_tokens=False)
            differ += again != prompt + g.token_ids
    assert tool_turns >= 3 and differ >= 3


# --------------------------------------------------------------------------------------------------
# Masks: scores, advantages and the losses ignore tool tokens
# --------------------------------------------------------------------------------------------------


def multi_turn_batch() -> RolloutBatch:
    items = items_for(["7", "3"])
    gens = [
        [Generation([16, 17, 11, 18, 15, 11, 2], None, "stop", [1, 0, 0, 0, 0, 1, 1], {"num_turns": 4})],
        [Generation([16, 17, 7, 18, 15, 7], None, "length", [1, 0, 0, 0, 0, 1], {"num_turns": 4})],
    ]
    return RolloutBatch.from_generations(items, gens, 0, 8, "s-")


def test_score_on_the_last_model_token_and_gae_grpo_skip_tool_tokens():
    from megatron_rl.algos.advantages import compute_gae, compute_grpo_outcome_advantage
    from megatron_rl.reward.scoring import place_scores

    batch = multi_turn_batch()
    place_scores(batch, torch.tensor([1.0, 0.5]))
    assert batch.token_level_scores[0].tolist() == [0, 0, 0, 0, 0, 0, 1.0]
    assert batch.token_level_scores[1].tolist() == [0, 0, 0, 0, 0, 0.5, 0]
    values = torch.randn(2, 7, generator=torch.Generator().manual_seed(1))
    mask = batch.response_mask
    adv, ret = compute_gae(batch.token_level_scores, values, mask, gamma=1.0, lam=1.0)
    assert (adv[mask == 0] == 0).all()
    # the model's first turn is credited through the tool tokens (hand computation, gamma = lam = 1):
    # its return is the episode's score, whatever values the critic gives the tool tokens
    assert ret[0, 0].item() == pytest.approx(1.0) and ret[1, 0].item() == pytest.approx(0.5)
    values2 = values.clone()
    values2[mask == 0] = 100.0
    _, ret2 = compute_gae(batch.token_level_scores, values2, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret2[mask == 1], ret[mask == 1])
    adv_g, _ = compute_grpo_outcome_advantage(batch.token_level_scores, mask, ["a", "a"])
    assert (adv_g[mask == 0] == 0).all() and adv_g[0, 0] > 0 > adv_g[1, 0]


def test_policy_value_and_kl_terms_have_no_gradient_on_tool_tokens():
    from megatron_rl.algos.kl import FixedKLController, apply_kl_penalty
    from megatron_rl.algos.losses import agg_loss, compute_value_loss
    from megatron_rl.algos.policy_loss import compute_policy_loss

    batch = multi_turn_batch()
    mask = batch.response_mask
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(2, 7, generator=gen)
    logp = old.clone().requires_grad_(True)  # ratio 1: no token is clipped, every model token has a gradient
    adv = torch.randn(2, 7, generator=gen)
    pg, *_ = compute_policy_loss(old, logp, adv, mask)
    entropy = torch.rand(2, 7, requires_grad=True)
    (pg + agg_loss(entropy, mask, "token-mean")).backward()
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask == 1] != 0).all()
    assert (entropy.grad[mask == 0] == 0).all()
    vpred = torch.randn(2, 7, requires_grad=True)
    vf, _ = compute_value_loss(
        vpred, torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen), mask, 0.5
    )
    vf.backward()
    assert (vpred.grad[mask == 0] == 0).all()
    rewards, _ = apply_kl_penalty(torch.zeros(2, 7), old, old + 1.0, mask, FixedKLController(0.1))
    assert (rewards[mask == 0] == 0).all() and (rewards[mask == 1] != 0).all()
    # compacted micro-batches keep the holes where they were
    c = batch.compacted()
    assert torch.equal(c.response_mask, mask) and c.attention_mask.sum() == batch.attention_mask.sum()


def test_concat_keeps_tool_tokens_attended():
    b = multi_turn_batch()
    cat = RolloutBatch.concat([b.select([0]), b.select([1])], 0)
    assert torch.equal(cat.response_mask, b.response_mask) and torch.equal(
        cat.attention_mask, b.attention_mask
    )


# --------------------------------------------------------------------------------------------------
# The GSM8K-with-a-calculator example: its rows, its tool config, the tools in the prompt
# --------------------------------------------------------------------------------------------------


def test_gsm8k_calculator_example(tmp_path):
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from megatron_rl.data import PromptDataset
    from megatron_rl.rollout.agent.tools import prompt_tool_schemas

    root = Path(__file__).resolve().parents[2] / "examples"
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        ex = {"question": "Tom has 3 bags of 4 apples. How many?", "answer": "3*4=12\n#### 12"}
        (src / f"{split}.jsonl").write_text(json.dumps(ex) + "\n")
    spec = importlib.util.spec_from_file_location(
        "mrl_gsm8k_mt", root / "data_preprocess" / "gsm8k_multiturn.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = module.main(["--local_dir", str(tmp_path / "out"), "--local_dataset_path", str(src)])
    mt = MultiTurnConfig(enable=True, tool_config_path=str(root / "tool_config" / "gsm8k_calculator.yaml"))
    schemas = prompt_tool_schemas(mt)
    assert [s["function"]["name"] for s in schemas] == ["calc"]
    calc = load_tools(mt.tool_config_path)["calc"]
    assert asyncio.run(calc.execute("i", {"expression": "3 * 4"}))[0].text == "12"
    assert asyncio.run(calc.create(create_kwargs={"ground_truth": "12"}))[0]  # tools_kwargs are accepted
    assert list(load_interactions(str(root / "tool_config" / "gsm8k_interaction.yaml"))) == ["gsm8k"]
    # a template that lists the tools: the prompts carry them
    tok = tools_task.build_tools_tokenizer()
    tok.chat_template = "{% for t in tools %}secret {% endfor %}" + tools_task.TOOLS_CHAT_TEMPLATE
    ds = PromptDataset([out["train"]], tok, 64, tools=schemas)
    assert ds[0].prompt_ids[0] == tok.convert_tokens_to_ids("secret")
    assert ds[0].extra_info["tools_kwargs"] == {"calc": {"create_kwargs": {"ground_truth": "12"}}}
    assert ds[0].ground_truth == "12" and ds[0].messages[0]["role"] == "system"


CHATML = (  # newlines as expressions: HF renders templates with trim_blocks
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_turn_encoder_on_a_chatml_template():
    """Qwen-style turns: consecutive tool replies share one user turn, and the "\\n" the template writes
    after <|im_end|> comes first, since the model's turn ended at <|im_end|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(["user assistant tool_response 42 17\n" * 4], trainer)
    from tokenizers import decoders

    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = CHATML
    enc = TurnEncoder(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = enc.encode([{"role": "tool", "content": "42"}, {"role": "tool", "content": "17"}], im_end)
    want = (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n17\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(ids) == want
    assert ids == tok.encode(want, add_special_tokens=False)
    # a turn that ended at another token gets the whole closing text of the template
    assert enc.separator(tok.convert_tokens_to_ids("4")) == "<|im_end|>\n"


def test_calls_of_one_turn_share_the_episode_instance_and_the_rest_are_dropped(tok):
    call = tok.convert_tokens_to_ids(CALL)
    close = tok.convert_tokens_to_ids(tools_task.REPLY_CLOSE)
    for parallel, replies, dropped in ((2, 2, 0), (1, 1, 1)):
        tool = LookupWithHooks()
        mt = MultiTurnConfig(enable=True, max_assistant_turns=2, max_parallel_calls=parallel)
        loop = AgentLoop(mt, single_ps(), tok, tools={"lookup": tool})
        engine = ScriptedEngine(lambda p: [tok.eos_token_id] if close in p else [call, call], {call})
        items = items_for(["5"])
        g = loop.run(engine, [items[0].prompt_ids], SamplingParams(max_new_tokens=30), items)[0][0]
        loop.shutdown()
        assert g.token_ids.count(close) == replies and g.info["tool_calls"] == replies
        assert g.info["dropped_calls"] == dropped
        assert len(tool.values) == 1 and tool.released == list(tool.values)  # one instance, released once
        assert g.info["tool_rewards"] == [0.25] * replies


def test_episodes_on_rollout_ranks_of_their_own_need_a_one_rank_engine():
    from megatron_rl.config import load_config, validate

    dims = {"num_attention_heads": 12, "num_key_value_heads": 2, "num_layers": 28}
    base = [
        "actor_rollout_ref.model.path=/models/x",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "trainer.placement.actor=[0]",
    ]
    validate(load_config(None, [*base, "trainer.placement.rollout=[1]"]), world_size=2, model_dims=dims)
    two = [*base, "trainer.placement.rollout=[1,2]", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    with pytest.raises(
        ConfigError, match=r"rollout\.tensor_model_parallel_size=1, data_parallel_size=1\): set"
    ):
        validate(load_config(None, two), world_size=3, model_dims=dims)


def test_episodes_keep_masks_and_info_through_the_store_and_a_checkpoint(tmp_path):
    from megatron_rl.roles.remote_rollout import MESSAGE_TYPES
    from megatron_rl.roles.transport import decode, encode, gens_from_wire, gens_to_wire

    info = {"num_turns": 4, "tool_rewards": [0.25], "reward_scores": {"lookup": 1.0}, "tool_reward": 1.25}
    gens = [
        [Generation([16, 17, 11, 2], [-0.5, math.nan, math.nan, -0.1], "stop", [1, 0, 0, 1], info)],
        [Generation([5, 2], None, "length")],  # a single-turn generation: no mask, no info
    ]
    wire = gens_to_wire(gens)
    torch.save(wire, tmp_path / "queue.pt")
    for back in (
        gens_from_wire(decode(encode(wire, MESSAGE_TYPES), MESSAGE_TYPES)),
        gens_from_wire(torch.load(tmp_path / "queue.pt", weights_only=True)),
    ):
        g, plain = back[0][0], back[1][0]
        assert (g.token_ids, g.finish_reason, g.response_mask, g.info) == (
            [16, 17, 11, 2],
            "stop",
            [1, 0, 0, 1],
            info,
        )
        assert g.logprobs[0] == -0.5 and math.isnan(g.logprobs[1])
        assert (plain.token_ids, plain.logprobs, plain.response_mask, plain.info) == (
            [5, 2],
            None,
            None,
            None,
        )
