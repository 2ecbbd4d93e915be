"""The OpenAI-compatible endpoint as a careless harness or an attacker meets it, over real sockets: a
connection flood gets 503s from a bounded set of threads, a client that trickles its request (or sends
nothing) is cut off at the read timeout and frees its slot, malformed bodies get 400 naming the field,
and an engine that fails mid-episode goes through the rollout's in-place restart (the fault of
tests/faults/workers/engine_fails.py)."""

from __future__ import annotations

import json
import logging
import runpy
import select
import socket
import threading
import time
import urllib.error
from dataclasses import replace

import pytest

from megatron_rl.config.rollout_sections import OpenAIServerConfig
from megatron_rl.rollout.agent.agent_function import run_agent_episodes
from megatron_rl.rollout.agent.openai_request import EndpointLimits
from megatron_rl.rollout.agent.openai_server import OpenAIServer
from megatron_rl.rollout.base import EngineFailure
from tests.faults.test_engine_restart import RESTART, WORKER
from tests.unit import test_openai_server as endpoint_tests
from tests.unit.test_openai_server import FIRST, TOOLS, CountingEngine, item, post, two_turns

setup = endpoint_tests.setup
"""The endpoint tests' fixture: the demo's tokenizer, a 2-layer Llama whose greedy first token is the
Hermes call, its transformers engine and the sampling parameters."""
LOGGER = "megatron_rl.rollout.agent.openai_server"


def wait_for(cond, what: str, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def status_line(sock: socket.socket) -> bytes:
    return sock.makefile("rb").readline()


def test_a_connection_flood_gets_503_and_no_threads(setup, caplog, capfd):
    tok, _, engine, params, _ = setup
    limits = EndpointLimits(max_connections=4, read_timeout_s=60)
    with (
        caplog.at_level(logging.DEBUG, logger=LOGGER),
        OpenAIServer(engine, tok, params, limits=limits).start(engine_thread=True) as srv,
    ):
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(4)]
        wait_for(lambda: srv.http.open_connections == 4, "the held connections have their threads")
        threads = threading.active_count()
        flood = []
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            flood.append(sock)
        replies = [status_line(s) for s in flood]
        assert all(r.startswith(b"HTTP/1.1 503 ") for r in replies), replies[:3]
        assert threading.active_count() <= threads  # a refused connection never had a thread
        assert (srv.http.refused, srv.http.open_connections) == (100, 4)
        for sock in held + flood:
            sock.close()
        wait_for(lambda: srv.http.open_connections == 0, "the closed connections free their slots")
        url = srv.base_url(srv.open_session("after"))
        assert post(url, {"messages": FIRST})["choices"][0]["token_ids"]  # served again
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "refusing" in warnings[0].getMessage()  # then DEBUG lines
    assert "Traceback" not in capfd.readouterr().err


def trickle(sock: socket.socket, data: bytes, every: float = 0.05) -> bool:
    """Send ``data`` a byte at a time; True as soon as the server has answered or closed."""
    for b in data:
        if select.select([sock], [], [], every)[0]:
            return True
        try:
            sock.sendall(bytes([b]))
        except OSError:  # closed by the server
            return True
    return bool(select.select([sock], [], [], 5)[0])


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_slow_or_silent_client_is_cut_off_at_the_read_timeout(setup, capfd):
    """One slot: a client trickling its request (slowloris) gets 408 once read_timeout_s has passed,
    one that sends nothing is closed; neither keeps the slot, and a request whose engine time is longer
    than the read timeout is still answered."""
    tok, _, engine, params, _ = setup
    gate = threading.Event()
    gated = CountingEngine(engine, gate)
    limits = EndpointLimits(max_connections=1, read_timeout_s=0.5)
    with OpenAIServer(gated, tok, params, limits=limits).start(engine_thread=True) as srv:
        path = f"/s/{srv.open_session('slow')}/v1/chat/completions"
        body = json.dumps({"messages": FIRST}).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            assert trickle(sock, head + body), "the trickling client was never cut off"
            reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408 ") and b"read_timeout_s=0.5" in reply
        # the handler frees its slot after the close the client has just read: wait for it
        wait_for(lambda: srv.http.open_connections == 0, "the trickling client frees its slot")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            assert read_all(sock) == b""  # idle: closed without a reply
        wait_for(lambda: srv.http.open_connections == 0, "the cut-off connections free their slot")
        assert srv.http.refused == 0
        got: list = []
        t = threading.Thread(target=lambda: got.append(post(srv.base_url("slow"), {"messages": FIRST})))
        t.start()
        wait_for(lambda: gated.sizes, "the request is with the engine")
        time.sleep(2 * limits.read_timeout_s)  # the engine takes longer than the read timeout
        gate.set()
        t.join(30)
        assert got and got[0]["choices"][0]["token_ids"]
    assert "Traceback" not in capfd.readouterr().err


def test_malformed_bodies_get_400_naming_the_field(setup, caplog, capfd):
    tok, _, engine, params, _ = setup
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    big = ('{"messages": [{"role": "user", "content": "secret"}], "max_tokens": ' + "9" * 5000 + "}").encode()
    cases = [
        (deep, ["'messages'", "64 levels", "max_json_depth"]),
        (big, ["'max_tokens'", "5000 digits", "max_int_digits"]),
        ({"messages": FIRST, "tools": "lookup"}, ["'tools'", "list of function specs"]),
        ({"messages": FIRST, "tools": {"lookup": {}}}, ["'tools'"]),
        ({"messages": FIRST, "tools": [1]}, ["'tools[0]'"]),
        ({"messages": FIRST, "tools": [{"type": "function", "function": {}}]}, ["'tools[0].function.name'"]),
        ({"messages": FIRST, "tools": [{"type": "function", "function": "f"}]}, ["'tools[0].function'"]),
        ({"messages": [FIRST[0]] * 2000}, ["'messages'", "2000 messages", "max_messages"]),
        ({"messages": [{"role": "user", "content": 7}]}, ["'messages[0].content'"]),
        ({"messages": [FIRST[0], "hi"]}, ["'messages[1]'"]),
    ]
    with (
        caplog.at_level(logging.DEBUG, logger=LOGGER),
        OpenAIServer(engine, tok, params).start(engine_thread=True) as srv,
    ):
        url = srv.base_url(srv.open_session("bad"))
        for body, needles in cases:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            with pytest.raises(urllib.error.HTTPError) as err:
                post(url, raw=raw)
            text = err.value.read().decode()
            assert err.value.code == 400, (needles, text)
            assert all(n in text for n in needles), (needles, text)
        r = post(url, {"messages": FIRST, "tools": TOOLS})  # the session is as it was
        assert r["choices"][0]["message"]["tool_calls"]
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert "Traceback" not in capfd.readouterr().err


@pytest.fixture
def engine_fails(monkeypatch):
    """``inject(step, times)``: the transformers engine's worker fails at the training rollout of
    ``step``, ``times`` times, as tests/faults/workers/engine_fails.py makes it fail (that module is
    run here, patching HFEngine.generate_local; the patch is undone after the test)."""
    from megatron_rl.rollout import hf_engine

    monkeypatch.setattr(hf_engine.HFEngine, "generate_local", hf_engine.HFEngine.generate_local)

    def inject(step: int, times: int) -> None:
        env = {"RANK": "0", "FAULT_RANK": "0", "FAULT_STEP": str(step), "FAULT_TIMES": str(times)}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        runpy.run_path(WORKER)

    return inject


def test_an_engine_failure_fails_the_episodes_with_the_engine_error(setup, engine_fails):
    """The harness's request gets 503 and run_agent_episodes raises the EngineFailure (what the rollout
    restarts on), not the harness's error."""
    tok, _, engine, params, _ = setup
    engine_fails(step=3, times=1)
    codes: list[int] = []

    def harness(item, base_url: str) -> float:
        try:
            post(base_url, {"messages": FIRST, "tools": TOOLS})
        except urllib.error.HTTPError as exc:
            codes.append(exc.code)
            raise
        return 1.0

    with pytest.raises(EngineFailure, match=r"the engine's worker died \(injected\)"):
        run_agent_episodes(engine, tok, [item(0)], harness, replace(params, step=3), OpenAIServerConfig())
    assert codes == [503]


HARNESS = """
from tests.unit.test_openai_server import two_turns

REPLIES = []
CALLS = []


def agent_fn(item, base_url):
    CALLS.append(item.index)
    return two_turns(REPLIES)(item, base_url)
"""


def test_an_engine_failure_in_an_endpoint_episode_restarts_the_engine_in_place(
    setup, ps, engine_fails, monkeypatch, tmp_path, capsys
):
    """The colocated rollout with multi_turn.agent_function: the engine fails at step 3's first request;
    the role restarts it in place (its line, rollout/engine_restarts), syncs the weights into the new
    engine and runs the step's episodes again, which come out as an uninterrupted run's."""
    import torch

    from megatron_rl.config import load_config, resolve
    from megatron_rl.model_args import model_args_from_hf_config
    from megatron_rl.roles.rollout import ColocatedRollout, Request, RolloutRole
    from megatron_rl.roles.rollout.generators import make_generator
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.run.memory_plan import config_plan
    from megatron_rl.run.metrics import Timer
    from tests.conftest import single_ps

    tok, oracle, engine, params, _ = setup
    weights = list(oracle.state_dict().items())

    def sync_weights(actor, ps, eng, *args) -> dict[str, float]:
        """The actor's weights stream into the (new) engine; no integrity check to time."""
        eng.update_weights([weights])
        return {"check_seconds": 0.0}

    monkeypatch.setattr("megatron_rl.rollout.reshard.sync_weights", sync_weights)
    args = model_args_from_hf_config({**oracle.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    started: list = []

    def new_engine():
        started.append(HFEngine(args, single_ps()))
        return started[-1]

    (tmp_path / "harness.py").write_text(HARNESS)
    cfg = load_config(None, ["actor_rollout_ref.model.path=/models/x"])
    cfg.actor_rollout_ref.rollout.dtype = "float32"  # what config.validate resolves on CPU
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    mt.enable, mt.agent_function.path = True, str(tmp_path / "harness.py")
    spec = resolve(cfg, "cpu").rollout
    generator = make_generator(cfg, ps, tok)
    rollout = ColocatedRollout(
        cfg.actor_rollout_ref.rollout, spec, ps, None, oracle, lambda parking: None, new_engine(),
        lambda: [0], generator, config_plan(cfg), new_engine=new_engine,
    )  # fmt: skip
    assert isinstance(rollout, RolloutRole)
    harness = rollout.generator.runner.fn.__globals__
    step = replace(params, step=3, n=2)
    engine_fails(step=3, times=1)
    gens, _ = rollout.generate(Request("train", 3), [[0]], step, Timer(torch.device("cpu")), [item(0)])
    out = capsys.readouterr().out
    assert out.count(RESTART) == 1 and "train/3: " + RESTART in out
    assert rollout.engine_restarts == 1 and rollout.engine is started[-1] and len(started) == 2
    assert len(harness["REPLIES"]) == 2  # the step's episodes, run again; the failed attempt's none
    assert len(harness["CALLS"]) >= 3  # the failed attempt called the harness too
    straight = run_agent_episodes(engine, tok, [item(0)], two_turns([]), step)
    assert [g.token_ids for g in gens[0]] == [g.token_ids for g in straight[0]]
    assert [g.response_mask for g in gens[0]] == [g.response_mask for g in straight[0]]
    assert rollout.step_metrics(3)["rollout/engine_restarts"] == 1.0
