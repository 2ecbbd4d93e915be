"""Model-based rewards in the real CPU demo job (torchrun, TP=2 over two gloo ranks): a reward model in
Megatron shards with its own chat template, and rewards from an HTTP server started by the test."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_rl.demo import prepare
from tests.distributed.test_trainer import _run_train, metrics


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("demo")))


def _reward_model(demo, path: str) -> str:
    """A tiny random Llama reward model whose tokenizer is the toy one with another chat template."""
    from megatron_rl.demo.toy import build_toy_tokenizer
    from megatron_rl.models.random_hf import save_random_hf_model

    tok = build_toy_tokenizer()
    # The same vocabulary, a different rendering: the reward model reads "<s> q = a </s>" per turn.
    tok.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    tok.save_pretrained(path)
    save_random_hf_model(
        path, "llama", seed=3, head="score", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return path


def test_reward_model_scores_flow_into_training(demo, tmp_path):
    rm = _reward_model(demo, str(tmp_path / "rm"))
    out = str(tmp_path / "run")
    kw = {
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "reward_model.enable": True,
        "reward_model.model.path": rm,
        "reward_model.megatron.param_offload": True,
    }
    proc = _run_train(demo, out, kw)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = metrics(out)
    last = rows[-1]
    # A random reward model gives continuous scores, unlike the toy rule's 0/1.
    assert math.isfinite(last["critic/score/mean"])
    assert last["critic/score/max"] > last["critic/score/min"]
    assert not {last["critic/score/max"], last["critic/score/min"]} <= {0.0, 1.0}
    assert "val-core/toy/copy_last_digit/reward/mean@1" in last


def test_reward_model_re_renders_the_conversation_in_its_own_template(demo, tmp_path):
    from megatron_rl.batch import RolloutBatch, SeqMeta
    from megatron_rl.demo.toy import build_toy_tokenizer
    from megatron_rl.reward.model import ModelReward, reward_model_tokenizer

    actor_tok = build_toy_tokenizer()
    rm_path = _reward_model(demo, str(tmp_path / "rm"))
    rm_tok = reward_model_tokenizer(rm_path, actor_tok)
    assert rm_tok is not None  # another chat template
    assert reward_model_tokenizer(demo["model"], actor_tok) is None  # the actor's own: tokens as they are
    messages = [{"role": "user", "content": "copy 3 7 ="}]
    prompt = torch.tensor([actor_tok.convert_tokens_to_ids(["copy", "3", "7", "="])])
    response = torch.tensor([actor_tok.convert_tokens_to_ids(["7", "</s>"])])
    batch = RolloutBatch.from_tokens(
        prompt, torch.ones_like(prompt), response, torch.ones(1, 2), [SeqMeta("u", messages=messages)]
    )
    scorer = ModelReward(None, None, 1, actor_tok, rm_tok, max_length=None)
    ids, mask = scorer._retokenize(batch)
    want = rm_tok.apply_chat_template([*messages, {"role": "assistant", "content": "7"}], tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ids[0].tolist() == list(want) and mask.sum().item() == len(want)
    ids, _ = ModelReward(None, None, 1, actor_tok, rm_tok, max_length=3)._retokenize(batch)
    assert ids[0].tolist() == list(want)[-3:]  # cut on the left: the score is read at the end


class _ToyRuleServer(BaseHTTPRequestHandler):
    """Scores like the toy rule (the response's first word equals the ground truth), plus an extra key."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        samples = body["samples"]
        scores = [
            float(s["response"].split(" ")[0] == str(s["ground_truth"])) if s["response"] else 0.0
            for s in samples
        ]
        reply = json.dumps(
            {"scores": scores, "extras": [{"chars": float(len(s["prompt"]))} for s in samples]}
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(reply.encode())

    def log_message(self, *args):
        pass


def test_rewards_from_a_reward_server(demo, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ToyRuleServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = str(tmp_path / "run")
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        kw = {"trainer.total_training_steps": 2, "trainer.test_freq": 2, "reward_model.http.url": url}
        proc = _run_train(demo, out, kw)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = metrics(out)[-1]
    assert set(torch.tensor([last["critic/score/max"], last["critic/score/min"]]).tolist()) <= {0.0, 1.0}
    assert last["reward/chars/mean"] > 0  # the prompt text reached the server, its extra key came back
    assert "val-core/toy/copy_last_digit/reward/mean@1" in last
    assert "val-aux/toy/copy_last_digit/chars/mean@1" in last
