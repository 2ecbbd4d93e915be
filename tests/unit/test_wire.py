"""The job store's wire format: what the roles exchange round-trips exactly; a pickle (or anything else
this format does not describe) under a role's key is refused in one line and never executed.
Signatures: tests/unit/test_store_signing.py."""

import datetime
import os
import pickle

import pytest
import torch
import torch.distributed as dist

from megatron_rl.batch import RolloutBatch, SeqMeta
from megatron_rl.job_secret import JobSecret
from megatron_rl.roles.critic import MESSAGE_TYPES as CRITIC_TYPES
from megatron_rl.roles.remote_rollout import MESSAGE_TYPES, WeightsPlan
from megatron_rl.roles.transport import Mailbox, WireError, decode, encode, gens_from_wire, gens_to_wire
from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.run.ports import free_port

SECRET = JobSecret.random()


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    yield s
    del s


class _Gadget:
    """Unpickling this runs ``os.system("touch <path>")``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_under_a_rollout_key_is_refused_not_run(store, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Gadget(str(marker)))
    # the control: this payload does run code when unpickled
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()

    dist.PrefixStore("rollout/", store).set("req/0", payload)
    box = Mailbox(store, SECRET, "rollout/", MESSAGE_TYPES)
    with pytest.raises(WireError) as err:
        box.take("req/0", 1)
    msg = str(err.value)
    assert "\n" not in msg and " rollout/req/0 " in msg and "looks like a pickle" in msg
    assert not marker.exists()


def test_a_pickle_under_a_critic_key_is_refused_not_run(store, tmp_path):
    marker = tmp_path / "pwned"
    dist.PrefixStore("critic/", store).set("batch/1/0", pickle.dumps(_Gadget(str(marker))))
    with pytest.raises(WireError, match=r" critic/batch/1/0 .*nothing of it was run"):
        Mailbox(store, SECRET, "critic/", CRITIC_TYPES).take("batch/1/0", 1)
    assert not marker.exists()


def _frame(header: bytes, data: bytes = b"") -> bytes:
    import struct

    return b"MRLW1\n" + struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize(
    "payload,why",
    [
        (_frame(b'{"body": {"__dc": "Popen", "f": {}}, "tensors": []}'), "not one this role reads"),
        (_frame(b'{"body": {"__obj": "os.system"}, "tensors": []}'), "unknown tag"),
        (_frame(b'{"body": {"__t": 0}, "tensors": [{"dtype": "object", "shape": [1]}]}'), "not allowed"),
        (
            _frame(
                b'{"body": 0, "tensors": [{"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}]}'
            ),
            "past the end",
        ),
        (_frame(b"not json"), "not JSON"),
        (b"MRLW1\n\xff\xff\xff\xff\xff\xff\xff\x7f", "past the end"),
    ],
)
def test_malformed_messages_are_refused(payload, why):
    with pytest.raises(WireError, match=why):
        decode(payload, MESSAGE_TYPES, key="rollout/req/3")


def test_the_roles_messages_round_trip(store):
    box = Mailbox(store, SECRET, "rollout/", MESSAGE_TYPES)
    params = SamplingParams(n=2, temperature=0.7, stop_token_ids=[3, 5], seed=11, return_logprobs=True)
    box.put("req/0", {"kind": "generate", "tag": "train/1", "prompts": [[1, 2], [3]], "params": params})
    box.put("req/1", {"kind": "weights", "plan": WeightsPlan(2, 1, 1 << 20, "bf16")})
    gens = [[Generation([1, 2], [-0.5, -1.25], "stop"), Generation([4], None, "length")]]
    box.put("res/train/1/0", (gens_to_wire(gens), 3, 0.25))
    assert box.take("req/0", 1)["params"] == params
    assert box.take("req/1", 1)["plan"] == WeightsPlan(2, 1, 1 << 20, "bf16")
    rows, version, seconds = box.take("res/train/1/0", 1)
    assert gens_from_wire(rows) == gens and version == 3 and seconds == 0.25

    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch.from_tokens(
        torch.randint(0, 50, (2, 3), generator=g),
        torch.ones(2, 3, dtype=torch.long),
        torch.randint(0, 50, (2, 4), generator=g),
        torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1.0]]),
        [SeqMeta("u0", "gsm8k", "42", {"split": "train"}), SeqMeta("u1", ground_truth={"a": [1, 2]})],
    )
    batch.old_log_probs = torch.randn(2, 4, generator=g, dtype=torch.float64)
    critic = Mailbox(store, SECRET, "critic/", CRITIC_TYPES)
    critic.put("batch/1/0", batch)
    critic.put("metrics/1", ({"critic/vf_loss": float("nan"), "x": 1.5}, {"num_steps": 3}))
    critic.put("values/1/0", torch.randn(2, 4, generator=g).to(torch.bfloat16))
    back = critic.take("batch/1/0", 1)
    for name in ("prompts", "responses", "input_ids", "attention_mask", "response_mask", "old_log_probs"):
        a, b = getattr(batch, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert back.values is None and back.meta == batch.meta
    metrics, counters = critic.take("metrics/1", 1)
    assert metrics["x"] == 1.5 and metrics["critic/vf_loss"] != metrics["critic/vf_loss"]
    assert counters == {"num_steps": 3}
    assert critic.take("values/1/0", 1).dtype == torch.bfloat16


def test_unregistered_types_do_not_travel():
    with pytest.raises(TypeError, match="not registered"):
        encode({"plan": WeightsPlan(1, 1, 1, "fp32")}, ())
    with pytest.raises(TypeError, match="cannot travel"):
        encode({"f": object()})
    assert decode(encode({1: "a", "__x": (1, 2)})) == {1: "a", "__x": (1, 2)}


def test_the_interface_that_reaches_a_host():
    from megatron_rl.run.ports import interface_of

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("no-such-host.invalid") is None
