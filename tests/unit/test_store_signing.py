"""Signed messages in the job's store (a real TCPStore): a message not signed with the job's secret --
well-formed or not, a copy of a signed one under another key, one signed with another secret -- is
refused in one line naming its key, before anything of it is decoded; a signed one round-trips; a rank
that fails leaves its cause for the readers at the other end; the secret itself comes from the
launcher's environment or the ranks refuse to start."""

from __future__ import annotations

import datetime
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from megatron_rl.errors import LaunchError
from megatron_rl.job_secret import ENV, JobSecret, read
from megatron_rl.roles import transport
from megatron_rl.roles.remote_rollout import MESSAGE_TYPES, WeightsPlan
from megatron_rl.roles.transport import SIGNED, ForgedMessage, Mailbox, PeerLeft, encode
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.run.explain import explain
from megatron_rl.run.ports import free_port

SECRET = JobSecret.random()


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=20))
    yield s
    del s


@pytest.fixture
def no_decoding(monkeypatch):
    """Records every call of the wire format's decoder: a refused message must never reach it."""
    calls: list[str] = []
    real = transport.decode

    def spy(payload, types=(), key="?", source="job store key"):
        calls.append(key)
        return real(payload, types, key, source)

    monkeypatch.setattr(transport, "decode", spy)
    return calls


def _refusal(store, key: str, value: bytes, prefix: str = "rollout/") -> str:
    dist.PrefixStore(prefix, store).set(key, value)
    with pytest.raises(ForgedMessage) as err:
        Mailbox(store, SECRET, prefix, MESSAGE_TYPES).take(key, 1)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_a_well_formed_unsigned_stop_is_refused_naming_the_key_before_decoding(store, no_decoding):
    msg = _refusal(store, "req/3", encode({"kind": "stop"}))  # what the rollout ranks would obey
    assert msg.startswith(
        "the job's store holds a message under rollout/req/3 that is not signed with this job's secret "
        "(no signature; a message of the wire format without one): "
    ), msg
    assert f"something other than this job wrote to its store (port {store.port})" in msg
    assert no_decoding == []
    assert explain(ForgedMessage(msg)) == msg  # the trainer prints it as `megatron-rl error: <msg>`


def test_a_signature_of_another_secret_is_refused(store, no_decoding):
    other = Mailbox(store, JobSecret.random(), "rollout/", MESSAGE_TYPES)
    msg = _refusal(store, "req/0", other.seal("req/0", {"kind": "stop"}))
    assert "under rollout/req/0 that is not signed with this job's secret (a wrong signature" in msg
    assert no_decoding == []


def test_a_signed_pickle_of_another_secret_never_runs(store, tmp_path, no_decoding):
    marker = tmp_path / "pwned"

    class Gadget:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Gadget())
    fake_mac = JobSecret.random().mac(transport.DOMAIN, b"rollout/req/0", payload)
    _refusal(store, "req/0", SIGNED + fake_mac + payload)
    msg = _refusal(store, "req/1", payload)
    assert "no signature; it looks like a pickle" in msg
    assert not marker.exists() and no_decoding == []


@pytest.mark.parametrize("value", [b"", SIGNED, SIGNED + b"\x00" * 31, b"MRLS1"])
def test_truncated_signed_values_are_refused(store, value):
    assert "under rollout/req/0 that is not signed" in _refusal(store, "req/0", value)


def test_signed_messages_round_trip(store, no_decoding):
    box = Mailbox(store, SECRET, "rollout/", MESSAGE_TYPES)
    params = SamplingParams(n=2, temperature=0.7, stop_token_ids=[3], seed=11, return_logprobs=True)
    sums = torch.randn(5, 2, dtype=torch.float64)
    box.put("req/0", {"kind": "generate", "tag": "train/1", "prompts": [[1, 2], [3]], "params": params})
    box.put("req/1", {"kind": "weights", "plan": WeightsPlan(2, 1, 1 << 20, "bf16")})
    box.put("sums/1", sums)
    assert box.take("req/0", 1)["params"] == params
    assert box.take("req/1", 1)["plan"] == WeightsPlan(2, 1, 1 << 20, "bf16")
    assert torch.equal(box.take("sums/1", 2), sums)
    assert box.take("sums/1", 2).dtype == torch.float64  # the second reader; then the key is gone
    assert not dist.PrefixStore("rollout/", store).check(["sums/1"])
    assert no_decoding == ["rollout/req/0", "rollout/req/1", "rollout/sums/1", "rollout/sums/1"]
    # another rank's Mailbox, with the same secret from its environment, reads what this one wrote
    Mailbox(store, JobSecret(b"the job's secret"), "critic/").put("ack/0", None)
    assert Mailbox(store, read({ENV: "the job's secret"}), "critic/").take("ack/0", 1) is None


def test_a_signed_message_copied_under_another_key_is_refused(store, no_decoding):
    box = Mailbox(store, SECRET, "rollout/", MESSAGE_TYPES)
    box.put("req/0", {"kind": "stop"})
    value = dist.PrefixStore("rollout/", store).get("req/0")  # what anyone at the port can read
    msg = _refusal(store, "req/5", value)
    assert "under rollout/req/5 that is not signed with this job's secret (a wrong signature" in msg
    assert "a message of another key copied here" in msg
    # the same key under another role's prefix
    assert "under critic/req/0 " in _refusal(store, "req/0", value, prefix="critic/")
    assert no_decoding == []
    assert box.take("req/0", 1) == {"kind": "stop"}  # the original still reads


def test_a_reader_raises_the_cause_a_failed_rank_left_instead_of_waiting(store):
    server = Mailbox(store, SECRET, "rollout/", MESSAGE_TYPES)
    client = Mailbox(store, SECRET, "rollout/", MESSAGE_TYPES)
    dist.PrefixStore("rollout/", store).set("req/0", encode({"kind": "stop"}))
    with pytest.raises(ForgedMessage) as err:
        server.take("req/0", 1)
    server.report_failure(2, err.value)
    start = time.monotonic()
    with pytest.raises(PeerLeft) as left:
        client.take("res/train/1/0", 1)  # would wait the store's 20 s
    assert time.monotonic() - start < 5
    line = str(left.value)
    assert line.startswith(f"rollout rank 2 left: {err.value}"), line
    assert "this rank is collateral" in line and "\n" not in line
    # a bug's cause is its type and first line
    critic = Mailbox(store, SECRET, "critic/")
    critic.report_failure(1, ValueError("bad shape\nmore"))
    with pytest.raises(PeerLeft, match=r"^critic rank 1 left: ValueError: bad shape \("):
        Mailbox(store, SECRET, "critic/").take("values/1/0", 1)


def test_a_forged_failure_notice_is_refused_too(store):
    dist.PrefixStore("rollout/", store).set("failed", encode({"rank": 2, "cause": "go home"}))
    with pytest.raises(ForgedMessage, match="under rollout/failed that is not signed"):
        Mailbox(store, SECRET, "rollout/").take("res/train/1/0", 1)


def test_a_reader_still_times_out_in_the_stores_words(store):
    store.set_timeout(datetime.timedelta(milliseconds=300))
    with pytest.raises(dist.DistStoreError, match=r"wait timeout after 300ms, keys: rollout/req/9"):
        Mailbox(store, SECRET, "rollout/").take("req/9", 1)


def test_the_secret_comes_from_the_launchers_environment():
    secret = read({ENV: "0123456789abcdef0123"})
    assert "0123" not in repr(secret)
    assert secret.mac(b"k", b"v") == JobSecret(b"0123456789abcdef0123").mac(b"k", b"v")
    assert secret.mac(b"k", b"v") != secret.mac(b"kv", b"")  # the parts are length-prefixed
    with pytest.raises(LaunchError) as err:
        read({})
    msg = str(err.value)
    assert "\n" not in msg and f"{ENV} is not set" in msg and "launch/torchrun.sh" in msg
    assert err.value.same_on_all_ranks
    with pytest.raises(LaunchError, match=f"{ENV} holds 5 characters, fewer than 16"):
        read({ENV: "short"})
