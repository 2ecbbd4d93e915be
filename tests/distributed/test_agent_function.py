"""An agent function in the PPO loop (torchrun, two gloo ranks, DP=2): a urllib harness written here
runs each episode through the OpenAI-compatible endpoint (ask, a "tool" message, ask again), the batch
is built from the sessions' tokens, the harness's reward reaches the score, and the engine's log-probs
of the model's tokens equal the actor's on the assembled sequences (so the response mask covered the
engine's tokens only: the appended tool tokens carry no engine log-prob)."""

import json
import os
import textwrap

import pytest

from megatron_rl.demo.tools_task import prepare

AGENT_FN = textwrap.dedent(
    """
    import json
    import urllib.request

    TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {}}}]


    def post(base_url, body):
        req = urllib.request.Request(
            base_url + "/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())


    def agent_fn(item, base_url):
        messages = list(item.messages)
        first = post(base_url, {"model": "policy", "messages": messages, "tools": TOOLS})
        reply = first["choices"][0]["message"]
        call = (reply.get("tool_calls") or [{"id": "call_0"}])[0]["id"]
        tool = {"role": "tool", "tool_call_id": call, "content": str(item.ground_truth)}
        post(base_url, {"model": "policy", "messages": [*messages, reply, tool]})
        return 3.0
    """
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(str(tmp_path_factory.mktemp("tools_demo")))


def test_agent_function_episodes_train(demo, tmp_path, torchrun):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT_FN)
    out = str(tmp_path / "run")
    kw = {
        "data.train_files": f"[{demo['train']}]",
        "data.val_files": f"[{demo['test']}]",
        "data.train_batch_size": 16,
        "data.val_batch_size": 16,
        "actor_rollout_ref.model.path": demo["model"],
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16,
        "critic.ppo_micro_batch_size_per_gpu": 16,
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": "null",
        "actor_rollout_ref.rollout.multi_turn.tool_reward_weight": 1.0,
        "actor_rollout_ref.rollout.multi_turn.agent_function.path": str(agent),
        "actor_rollout_ref.rollout.calculate_log_probs": "true",
        "actor_rollout_ref.rollout.n": 4,  # the demo's 8 samples would double the sizes
        "trainer.default_local_dir": out,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.val_before_train": "false",
    }
    torchrun("train.py", 2, ["--config", "yaml/cpu_demo_tools.yaml", *(f"{k}={v}" for k, v in kw.items())])
    with open(os.path.join(out, "logs", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # every episode asked twice: 2 model turns and the tool turn, unless the first turn spent the
        # response budget (data.max_response_length), which ends the episode with 2 turns
        assert 2 <= r["multi_turn/num_turns/min"] <= r["multi_turn/num_turns/mean"]
        assert r["multi_turn/num_turns/max"] == 4 and r["multi_turn/num_turns/mean"] >= 2
        assert 0 <= r["multi_turn/length_ended_ratio"] <= 1
        # the harness's 3.0 (times tool_reward_weight 1) is added to the rule's 0 or 1
        assert 3.0 <= r["critic/score/mean"] <= 4.0
        # the actor scores exactly the sequences the engine produced (session prompt + served and
        # appended tokens), and only the engine's tokens are on the response mask
        assert r["training/rollout_probs_diff_max"] < 1e-3
    assert "val-core/toy/tool_lookup/acc/mean@1" in rows[-1]
