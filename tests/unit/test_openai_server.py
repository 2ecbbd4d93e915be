"""The OpenAI-compatible endpoint on the transformers engine: a urllib harness runs episodes with a tool
call; the recorded sequence is token-exact (against the replies' ids and an independent forward of the
model), the masks mark the engine's tokens, concurrent sessions' turns share engine calls without their tokens
depending on it, and the bounds
(body size, loopback only, request timeout, session count) hold."""

from __future__ import annotations

import json
import logging
import math
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from megatron_rl.config.rollout_sections import OpenAIServerConfig
from megatron_rl.data import PromptItem
from megatron_rl.demo import tools_task
from megatron_rl.rollout.agent.agent_function import run_agent_episodes
from megatron_rl.rollout.agent.openai_server import OpenAIServer, quiet_http_client_logs
from megatron_rl.rollout.base import SamplingParams
from tests.conftest import single_ps

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {}}}]
FIRST = [{"role": "user", "content": "secret"}]


@pytest.fixture(scope="module")
def setup():
    """The demo's 19-word tokenizer and a random 2-layer Llama whose greedy first token after the
    prompt is the (one-token) Hermes call: the lm_head rows of the call and of the original argmax
    are swapped."""
    from megatron_rl.model_args import model_args_from_hf_config
    from megatron_rl.models.random_hf import random_hf_model
    from megatron_rl.rollout.hf_engine import HFEngine

    tok = tools_task.build_tools_tokenizer()
    dims = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=64,
                tie_word_embeddings=False)  # fmt: skip
    oracle = random_hf_model("llama", seed=3, init="o1", **dims).eval()
    call = tok.convert_tokens_to_ids(tools_task.CALL_TOKEN)
    prompt = tok.encode(tok.apply_chat_template(FIRST, add_generation_prompt=True, tokenize=False))
    with torch.no_grad():
        top = int(oracle(torch.tensor([prompt])).logits[0, -1].argmax())
        w = oracle.lm_head.weight
        w[[top, call]] = w[[call, top]].clone()
        assert int(oracle(torch.tensor([prompt])).logits[0, -1].argmax()) == call
    args = model_args_from_hf_config({**oracle.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    engine = HFEngine(args, single_ps())
    engine.update_weights([list(oracle.state_dict().items())])
    params = SamplingParams(
        max_new_tokens=12, stop_token_ids=[tok.eos_token_id, call], greedy=True, return_logprobs=True, seed=5
    )
    return tok, oracle, engine, params, call


def post(url: str, body: dict | None = None, raw: bytes | None = None, timeout: float = 60) -> dict:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + "/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def two_turns(replies: list, barrier: threading.Barrier | None = None):
    """The harness: ask, answer the first tool call with "7", ask again."""

    def agent(item, base_url: str) -> float:
        if barrier is not None:
            barrier.wait()
        r1 = post(base_url, {"model": "any", "messages": FIRST, "tools": TOOLS})
        msg = r1["choices"][0]["message"]
        call_id = (msg.get("tool_calls") or [{"id": "none"}])[0]["id"]
        answer = {"role": "tool", "tool_call_id": call_id, "content": "7"}
        r2 = post(base_url, {"model": "any", "messages": [*FIRST, msg, answer]})
        replies.append((r1, r2))
        return 1.0

    return agent


def item(i: int) -> PromptItem:
    return PromptItem(prompt_ids=[0], data_source=tools_task.TOOLS_DATA_SOURCE, ground_truth="7", index=i)


def check_logprobs(oracle, prompt: list[int], g) -> None:
    """The engine's log-probs of its own tokens equal an independent forward of the recorded sequence:
    the engine saw exactly these tokens before each of its own."""
    seq = torch.tensor([prompt + g.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(oracle(seq).logits[0, :-1].float(), -1)  # [S-1, V]
    lp = lp[len(prompt) - 1 :].gather(-1, seq[0, len(prompt) :, None])[:, 0]  # [R]
    model = torch.tensor(g.response_mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(g.logprobs)[model], lp[model], atol=1e-4, rtol=0)
    assert all(math.isnan(x) for x in torch.tensor(g.logprobs)[~model].tolist())


def test_two_turn_episode_is_token_exact_and_masked(setup):
    tok, oracle, engine, params, call = setup
    replies: list = []
    (gens,) = run_agent_episodes(engine, tok, [item(0)], two_turns(replies), params, OpenAIServerConfig())
    (g,) = gens
    ((r1, r2),) = replies
    ids = tok.convert_tokens_to_ids
    prompt = [ids("secret"), ids("=")]
    served1, served2 = r1["choices"][0]["token_ids"], r2["choices"][0]["token_ids"]
    # the tool message, appended as the chat template renders it after the model's turn
    appended = [ids(tools_task.REPLY_OPEN), ids("7"), ids(tools_task.REPLY_CLOSE), ids("=")]
    assert g.info["prompt_ids"] == r1["prompt_token_ids"] == prompt
    assert served1 == [call]
    assert r2["prompt_token_ids"] == prompt + served1 + appended  # never a re-tokenised transcript
    assert g.token_ids == served1 + appended + served2
    assert g.response_mask == [1] * len(served1) + [0] * len(appended) + [1] * len(served2)
    check_logprobs(oracle, prompt, g)
    # the OpenAI shape: the Hermes call parsed out of the content
    m1 = r1["choices"][0]
    assert m1["finish_reason"] == "tool_calls" and m1["message"]["content"] is None
    assert [c["function"] for c in m1["message"]["tool_calls"]] == [{"name": "lookup", "arguments": "{}"}]
    assert r2["usage"] == {
        "prompt_tokens": len(prompt) + 1 + len(appended),
        "completion_tokens": len(served2),
        "total_tokens": len(prompt) + 1 + len(appended) + len(served2),
    }
    assert (g.info["assistant_turns"], g.info["user_turns"], g.info["num_turns"]) == (2, 1, 4)
    assert g.info["agent_reward"] == 1.0 and g.info["tool_calls"] >= 1


class CountingEngine:
    """The real engine, with the size of every generate call recorded (a boundary counter)."""

    def __init__(self, engine, gate: threading.Event | None = None) -> None:
        self.engine, self.gate, self.sizes = engine, gate, []

    def generate(self, prompts, params):
        self.sizes.append(len(prompts))
        if self.gate is not None:
            assert self.gate.wait(30)
        return self.engine.generate(prompts, params)


def test_concurrent_sessions_share_engine_calls(setup):
    # each request is a turn on the engine's turn server: turns pending together go in one engine call
    tok, oracle, engine, params, _ = setup
    counting = CountingEngine(engine)
    replies: list = []
    items = [item(i) for i in range(3)]
    gens = run_agent_episodes(counting, tok, items, two_turns(replies, threading.Barrier(6, timeout=30)),
                              replace_n(params, 2))  # fmt: skip
    assert max(counting.sizes) > 1
    assert sum(counting.sizes) == 12  # 6 episodes x 2 requests
    assert [len(per) for per in gens] == [2, 2, 2]
    for per in gens:
        for g in per:
            check_logprobs(oracle, g.info["prompt_ids"], g)  # token-exact inside a batch too
            assert g.response_mask.count(0) == 4


def test_a_sessions_tokens_do_not_depend_on_its_batch(setup):
    # sampled turns (temperature 1): each turn's seed is its episode's row and turn, so six sessions at
    # once (their turns batched) sample exactly what one session at a time does; another seed differs
    from dataclasses import replace

    tok, _, engine, params, _ = setup
    sampled = replace(params, greedy=False, n=2)
    items = [item(i) for i in range(3)]

    def tokens(cfg: OpenAIServerConfig, p: SamplingParams) -> list:
        gens = run_agent_episodes(engine, tok, items, two_turns([]), p, cfg, dp_rank=1)
        return [(g.token_ids, g.response_mask) for per in gens for g in per]

    together = tokens(OpenAIServerConfig(max_sessions=6), sampled)
    assert together == tokens(OpenAIServerConfig(max_sessions=1), sampled)
    assert len({tuple(t) for t, _ in together}) > 1  # the six episodes are not all alike
    assert together != tokens(OpenAIServerConfig(max_sessions=6), replace(sampled, seed=6))


def replace_n(params: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, n=n)


def test_oversized_body_gets_413(setup):
    tok, _, engine, params, _ = setup
    with OpenAIServer(engine, tok, params, OpenAIServerConfig(max_body_bytes=1000)).start(
        engine_thread=True
    ) as srv:
        url = srv.base_url(srv.open_session("big"))
        body = json.dumps({"messages": [{"role": "user", "content": "secret " * 1000}]}).encode()
        with pytest.raises(urllib.error.HTTPError) as err:
            post(url, raw=body)
        assert err.value.code == 413 and "max_body_bytes=1000" in err.value.read().decode()
        assert post(url, {"messages": FIRST})["choices"][0]["token_ids"]  # the server goes on


def test_binding_off_loopback_is_refused(setup):
    tok, _, engine, params, _ = setup
    for host in ("0.0.0.0", "192.168.1.10", "localhost"):
        with pytest.raises(ValueError, match="set host to 127.0.0.1"):
            OpenAIServer(engine, tok, params, OpenAIServerConfig(host=host))


def test_request_timeout_is_an_http_error_and_leaves_the_session(setup):
    tok, _, engine, params, _ = setup
    gate = threading.Event()
    gated = CountingEngine(engine, gate)
    cfg = OpenAIServerConfig(request_timeout_s=0.5)
    with OpenAIServer(gated, tok, params, cfg).start(engine_thread=True) as srv:
        sid = srv.open_session("slow")
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            post(srv.base_url(sid), {"messages": FIRST})
        assert err.value.code == 504 and "request_timeout_s=0.5" in err.value.read().decode()
        assert time.monotonic() - t0 < 10
        gate.set()  # the engine finishes the abandoned request; its result is dropped
        cfg.request_timeout_s = 60
        r = post(srv.base_url(sid), {"messages": FIRST})
        s = srv.close_session(sid)
    assert s.prompt == r["prompt_token_ids"] and s.tokens == r["choices"][0]["token_ids"]
    assert s.assistant_turns == 1


def test_sessions_are_bounded_and_follow_ups_must_continue(setup):
    tok, _, engine, params, _ = setup
    with OpenAIServer(engine, tok, params, OpenAIServerConfig(max_sessions=2)).start(
        engine_thread=True
    ) as srv:
        a = srv.open_session("a")
        srv.open_session("b")
        with pytest.raises(RuntimeError, match="max_sessions=2"):
            srv.open_session("c")
        with pytest.raises(urllib.error.HTTPError) as err:
            post(srv.base_url("nope"), {"messages": FIRST})
        assert err.value.code == 404
        msg = post(srv.base_url(a), {"messages": FIRST})["choices"][0]["message"]
        changed = [{"role": "user", "content": "="}, msg, {"role": "tool", "content": "7"}]
        with pytest.raises(urllib.error.HTTPError) as err:
            post(srv.base_url(a), {"messages": changed})
        assert err.value.code == 400 and "token in, token out" in err.value.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/v1/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == OpenAIServerConfig().model_name


def test_many_sessions_connecting_at_once_are_all_served(setup):
    """Every harness of a rollout connects at the same moment: the listen backlog holds them all."""
    tok, _, engine, params, _ = setup
    replies: list = []
    items = [item(i) for i in range(20)]
    barrier = threading.Barrier(40, timeout=30)
    gens = run_agent_episodes(engine, tok, items, two_turns(replies, barrier), replace_n(params, 2))
    assert len(replies) == 40 and all(len(per) == 2 for per in gens)


def test_a_failing_harness_is_named_as_such_not_as_a_dead_rank(setup):
    """A harness that raises (here as a dropped connection would) fails the rollout in one line naming
    the agent function and the prompt row; the failure explanation keeps that line."""
    from megatron_rl.rollout.agent.agent_function import AgentFunctionError
    from megatron_rl.run.explain import explain

    tok, _, engine, params, _ = setup

    def harness(item, base_url: str) -> float:
        raise ConnectionResetError("[Errno 104] Connection reset by peer")

    with pytest.raises(AgentFunctionError) as err:
        run_agent_episodes(engine, tok, [item(4)], harness, params, OpenAIServerConfig())
    line = explain(err.value)
    assert line is not None and line.startswith("actor_rollout_ref.rollout.multi_turn.agent_function")
    assert "prompt row 4" in line and "ConnectionResetError" in line and "another rank" not in line
    # negative control: the same text in a plain RuntimeError reads as a rank that died
    assert "lost its connection to another rank" in (explain(RuntimeError(str(err.value))) or "")


def raw_post(port: int, path: str, headers: str, body: bytes = b"") -> bytes:
    """One request written byte for byte (header values as latin-1, as http.server reads them); the
    reply's status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode("latin-1") + body)
        return sock.makefile("rb").readline()


def test_a_malformed_content_length_gets_400(setup, capfd):
    tok, _, engine, params, _ = setup
    with OpenAIServer(engine, tok, params).start(engine_thread=True) as srv:
        path = f"/s/{srv.open_session('cl')}/v1/chat/completions"
        # "\xb2" is "²": str.isdigit() takes it, int() does not
        for value in ("abc", "-1", "1 2", "\xb2"):
            assert b" 400 " in raw_post(srv.port, path, f"Content-Length: {value}\r\n"), value
        assert b" 411 " in raw_post(srv.port, path, "")
        assert post(srv.base_url("cl"), {"messages": FIRST})["choices"][0]["token_ids"]  # the server goes on
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_that_hangs_up_is_one_debug_line(setup, capfd, caplog):
    """The harness's socket is reset while its request is with the engine: the reply has nowhere to go."""
    tok, _, engine, params, _ = setup
    gate = threading.Event()
    gated = CountingEngine(engine, gate)
    name = "megatron_rl.rollout.agent.openai_server"
    with (
        caplog.at_level(logging.DEBUG, logger=name),
        OpenAIServer(gated, tok, params).start(engine_thread=True) as srv,
    ):
        path = f"/s/{srv.open_session('gone')}/v1/chat/completions"
        body = json.dumps({"messages": FIRST}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while not gated.sizes and time.monotonic() < deadline:  # the request is with the engine
            time.sleep(0.01)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, as a killed harness leaves it
        gate.set()
        while time.monotonic() < deadline and not any("hung up" in r.getMessage() for r in caplog.records):
            time.sleep(0.01)
        assert post(srv.base_url(srv.open_session("next")), {"messages": FIRST})["choices"][0]["token_ids"]
    lines = [r for r in caplog.records if r.name == name]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG and "hung up" in lines[0].getMessage()
    assert "Traceback" not in capfd.readouterr().err


@pytest.fixture
def http_client_loggers():
    """httpx/httpcore and the root logger as a fresh process has them, restored after."""
    loggers = [logging.getLogger(n) for n in ("httpx", "httpcore", "")]
    saved = [lg.level for lg in loggers]
    loggers[0].setLevel(logging.NOTSET)
    loggers[1].setLevel(logging.NOTSET)
    loggers[2].setLevel(logging.INFO)  # the trainer's rank 0
    yield loggers
    for lg, level in zip(loggers, saved, strict=True):
        lg.setLevel(level)


def test_http_client_info_lines_are_kept_off_the_console(setup, http_client_loggers):
    tok, _, engine, params, _ = setup
    httpx, httpcore, _ = http_client_loggers
    OpenAIServer(engine, tok, params).start().shutdown()
    assert httpx.level == httpcore.level == logging.WARNING
    assert not httpx.isEnabledFor(logging.INFO)


def test_http_client_logs_stay_when_debug_was_asked_for(http_client_loggers):
    httpx, httpcore, root = http_client_loggers
    httpx.setLevel(logging.INFO)  # the user's own choice
    quiet_http_client_logs()
    assert (httpx.level, httpcore.level) == (logging.INFO, logging.WARNING)
    httpcore.setLevel(logging.NOTSET)
    root.setLevel(logging.DEBUG)
    quiet_http_client_logs()
    assert (httpx.level, httpcore.level) == (logging.INFO, logging.NOTSET)
