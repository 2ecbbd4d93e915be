"""How roles on ranks of their own talk: the job's key-value store (:class:`Mailbox`), process groups
across roles for bulk tensors (:func:`bridge_group`), and the store's wire format -- signed, a JSON
header and raw tensor bytes, never pickle.

Roles on ranks of their own (``roles.remote_rollout``, ``roles.critic_server``) exchange requests,
generations and small results through torchrun's TCPStore (the critic's batches and values travel over
a bridge group: ``roles.critic_data``), which any process that reaches its port can write to. Every
value a Mailbox puts is signed with the job's secret (``job_secret.JobSecret``, from the launcher), and
a reader checks the signature before it decodes anything:

    b"MRLS1\\n" | HMAC-SHA256(secret; DOMAIN, full key, payload) (32 bytes) | payload

The full key is the Mailbox's prefix and key (``rollout/req/3``), so a message copied under another key
fails the check. Every key is written once in a store's life (requests are numbered, results named by
their request's tag or step, and a new torchrun starts a new store), so a copy under its own key finds
no reader after its readers took the original. A value without a valid signature is refused in one
line naming the key (:class:`ForgedMessage`). The payload is the wire format; decoding it is still
checked, so a bug on the writing side cannot run code either:

    b"MRLW1\\n" | header length (8 bytes, little endian) | JSON header | tensor bytes

The header is ``{"body": <value>, "tensors": [{"dtype", "shape", "offset", "nbytes"}, ...]}``. A value
is JSON (str, int, float, bool, None, lists, dicts with str keys) or a tagged object:

    {"__t": i}                         tensor i of the header (torch.frombuffer; dtype from DTYPES)
    {"__tuple": [...]}                 a tuple
    {"__map": [[k, v], ...]}           a dict whose keys are not all strings (or start with "__")
    {"__dc": "Name", "f": {...}}       a dataclass the reader registered by name (its fields only)

Decoding accepts nothing else: an unknown tag, a dtype outside :data:`DTYPES`, a tensor whose bytes
lie outside the payload, or a payload without the magic (a pickle, say) raises :class:`WireError`
naming the key, and nothing of the payload is executed.

:func:`all_gather_objects` and :func:`broadcast_object` carry the same payloads over a process group
(uint8 tensors), for the roles' small control values in place of torch's pickling ``*_object``
collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hmac
import json
import logging
import math
import struct
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_rl.errors import COLLATERAL, LaunchError
from megatron_rl.rollout.base import Generation

if TYPE_CHECKING:
    from megatron_rl.job_secret import JobSecret

log = logging.getLogger(__name__)

MAGIC = b"MRLW1\n"
SIGNED = b"MRLS1\n"
DOMAIN = b"megatron-rl job store message v1"
"""Bound into every signature: a MAC the job's secret makes for anything else never verifies here."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The tensor dtypes a payload may carry."""

DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
"""The name :data:`DTYPES` gives each dtype."""


class WireError(LaunchError):
    """A store value that is not a well-formed message of this format; nothing of it was executed. Its
    message is one line (the trainer prints it as ``megatron-rl error: ...``)."""


class ForgedMessage(WireError):
    """A store value under a role's key without this job's signature: refused before decoding."""


class PeerLeft(LaunchError):
    """A rank of the role at the other end of a Mailbox failed and left; the message is its cause."""


def _dc_registry(types: tuple[type, ...]) -> dict[str, type]:
    out = {}
    for t in types:
        if not dataclasses.is_dataclass(t):
            raise TypeError(f"{t!r} is not a dataclass")
        out[t.__name__] = t
    return out


def encode(obj: Any, types: tuple[type, ...] = ()) -> bytes:
    """``obj`` as one payload; dataclasses must be among ``types`` (the reader registers the same)."""
    registry = _dc_registry(types)
    blobs: list[bytes] = []
    metas: list[dict] = []
    offset = 0

    def enc(x: Any) -> Any:
        nonlocal offset
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            if x.dtype not in DTYPE_NAMES:
                raise TypeError(f"tensor dtype {x.dtype} cannot travel the store (allowed: {sorted(DTYPES)})")
            t = x.detach().to("cpu").contiguous()
            # bytes of any dtype (bfloat16 included) through a uint8 view
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            metas.append(
                {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "offset": offset, "nbytes": len(data)}
            )
            blobs.append(data)
            offset += len(data)
            return {"__t": len(metas) - 1}
        if isinstance(x, tuple):
            return {"__tuple": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v) for k, v in x.items()}
            return {"__map": [[enc(k), enc(v)] for k, v in x.items()]}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            name = type(x).__name__
            if registry.get(name) is not type(x):
                raise TypeError(f"{name} is not registered for the store (types={sorted(registry)})")
            return {"__dc": name, "f": {f.name: enc(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        if hasattr(x, "tolist") and hasattr(x, "dtype"):  # numpy scalars / arrays from parquet columns
            return enc(x.tolist())
        raise TypeError(f"{type(x).__name__} cannot travel the store (JSON values, tensors, dataclasses)")

    header = json.dumps({"body": enc(obj), "tensors": metas}).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *blobs])


def decode(
    payload: bytes, types: tuple[type, ...] = (), key: str = "?", source: str = "job store key"
) -> Any:
    """The value :func:`encode` wrote; :class:`WireError` naming ``source`` and ``key`` for all else."""
    registry = _dc_registry(types)

    def bad(why: str) -> WireError:
        return WireError(
            f"{source} {key!r}: refused a value that is not a megatron-rl message ({why}); nothing of "
            "it was run. Something other than this job wrote it: check who can reach the job's ports "
            "(docs/reliability.md, Security and ports)."
        )

    payload = bytes(payload)
    if not payload.startswith(MAGIC):
        hint = "; it looks like a pickle" if payload[:1] == b"\x80" else ""
        raise bad(f"starts with {payload[:8]!r}{hint}")
    start = len(MAGIC) + 8
    if len(payload) < start:
        raise bad("truncated header")
    (hlen,) = struct.unpack("<Q", payload[len(MAGIC) : start])
    if start + hlen > len(payload):
        raise bad(f"header of {hlen} bytes past the end of the value")
    try:
        header = json.loads(payload[start : start + hlen])
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or "body" not in header or not isinstance(header.get("tensors"), list):
        raise bad("header lacks body/tensors")
    data = memoryview(payload)[start + hlen :]
    tensors: list[torch.Tensor] = []
    for i, m in enumerate(header["tensors"]):
        if not isinstance(m, dict) or m.get("dtype") not in DTYPES:
            raise bad(f"tensor {i}: dtype {m.get('dtype') if isinstance(m, dict) else m!r} not allowed")
        shape, off, nbytes = m.get("shape"), m.get("offset"), m.get("nbytes")
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise bad(f"tensor {i}: bad shape {shape!r}")
        dtype = DTYPES[m["dtype"]]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not (
            isinstance(off, int)
            and isinstance(nbytes, int)
            and off >= 0
            and nbytes == math.prod(shape) * itemsize
        ):
            raise bad(f"tensor {i}: {nbytes!r} bytes do not fit shape {shape} of {m['dtype']}")
        if off + nbytes > len(data):
            raise bad(f"tensor {i}: bytes {off}..{off + nbytes} past the end of the value")
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(bytearray(data[off : off + nbytes]), dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(shape))

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        tags = [k for k in x if k.startswith("__")]
        if not tags:
            return {k: dec(v) for k, v in x.items()}
        if tags == ["__t"] and len(x) == 1 and isinstance(x["__t"], int) and 0 <= x["__t"] < len(tensors):
            return tensors[x["__t"]]
        if tags == ["__tuple"] and len(x) == 1 and isinstance(x["__tuple"], list):
            return tuple(dec(v) for v in x["__tuple"])
        if tags == ["__map"] and len(x) == 1 and isinstance(x["__map"], list):
            if not all(isinstance(kv, list) and len(kv) == 2 for kv in x["__map"]):
                raise bad("malformed map")
            return {_hashable(dec(k)): dec(v) for k, v in x["__map"]}
        if tags == ["__dc"] and set(x) == {"__dc", "f"} and isinstance(x["f"], dict):
            cls = registry.get(x["__dc"])
            if cls is None:
                raise bad(f"type {x['__dc']!r} is not one this role reads (it reads {sorted(registry)})")
            names = {f.name for f in dataclasses.fields(cls) if f.init}
            if not set(x["f"]) <= names:
                raise bad(f"{x['__dc']} has no fields {sorted(set(x['f']) - names)}")
            return cls(**{k: dec(v) for k, v in x["f"].items()})
        raise bad(f"unknown tag {tags}")

    def _hashable(k: Any) -> Any:
        if isinstance(k, (list, dict, torch.Tensor)):
            raise bad("unhashable map key")
        return k

    return dec(header["body"])


# ------------------------------------------------------------------- objects over process groups


def _as_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def all_gather_objects(obj: Any, group, device: torch.device, types: tuple[type, ...] = ()) -> list:
    """Every rank's ``obj`` of ``group``, in group-rank order: :func:`encode`'s bytes over two
    all-gathers (sizes, then the padded payloads) instead of torch's pickling ``all_gather_object``."""
    data = _as_tensor(encode(obj, types), device)
    n = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    counts = [int(x.item()) for x in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    outs = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(outs, padded, group=group)
    return [
        decode(o[:c].cpu().numpy().tobytes(), types, key=f"rank {r}", source="process group message from")
        for r, (o, c) in enumerate(zip(outs, counts, strict=True))
    ]


def broadcast_object(obj: Any, src: int, group, device: torch.device, types: tuple[type, ...] = ()) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (size, then bytes; no pickle)."""
    mine = dist.get_rank() == src
    data = (
        _as_tensor(encode(obj, types), device) if mine else torch.empty(0, dtype=torch.uint8, device=device)
    )
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not mine:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return decode(data.cpu().numpy().tobytes(), types, key=f"rank {src}", source="process group message from")


# ---------------------------------------------------------------------------------------------- roles


def job_store(ps) -> dist.Store:
    """The job's key-value store (``ParallelState.job_store``), set when a role has ranks of its own."""
    if ps.job_store is None:
        raise RuntimeError(
            "a role on ranks of its own needs the job's store: parallel.init_parallel(ranks=...) sets it "
            "for the run's placement (trainer.placement.*)"
        )
    return ps.job_store


def slice_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of ``parts`` contiguous slices of ``total`` items, sizes differing by at most 1."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for j in range(parts):
        end = start + base + (j < extra)
        out.append((start, end))
        start = end
    return out


def gens_to_wire(gens: list[list[Generation]]) -> list[list[tuple]]:
    """Generations as tuples of JSON values (the store's wire format, ``torch.load(weights_only=True)``):
    token ids, log-probs, finish reason, and for multi-turn episodes the response mask and the episode's
    info."""
    return [
        [
            (g.token_ids, g.logprobs, g.finish_reason)
            if g.response_mask is None
            else (g.token_ids, g.logprobs, g.finish_reason, g.response_mask, g.info)
            for g in per_prompt
        ]
        for per_prompt in gens
    ]


def gens_from_wire(rows: list[list[tuple]]) -> list[list[Generation]]:
    """:func:`gens_to_wire`'s inverse."""
    out = []
    for row in rows:
        per = []
        for t in row:
            lp = None if t[1] is None else list(t[1])
            mask, info = (list(t[3]), dict(t[4] or {})) if len(t) == 5 else (None, None)
            per.append(Generation(list(t[0]), lp, t[2], mask, info))
        out.append(per)
    return out


def job_mailbox(ps, prefix: str, types: tuple[type, ...] = ()) -> Mailbox:
    """The Mailbox of a role on ranks of its own: the job's store and secret of ``ps`` (init_parallel)."""
    if ps.job_secret is None:
        raise RuntimeError("the job's store has no secret: parallel.init_parallel(ranks=...) reads it")
    return Mailbox(job_store(ps), ps.job_secret, prefix, types)


def _port_of(store: dist.Store) -> int | None:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return getattr(store, "port", None)


FAILED = "failed"
"""The key under which a rank of a role that fails leaves its cause (:meth:`Mailbox.report_failure`)."""

POLL_S = (0.001, 0.02)
"""A reader's pauses between looks at a key it waits for, doubling from the first to the second (s)."""


class Mailbox:
    """Signed values under keys of the job's store (module docstring); ``take`` deletes a key after its
    last reader. ``secret``: the job's (``ParallelState.job_secret``); ``types``: the dataclasses the
    messages may hold (by name).

    A reader that waits also watches :data:`FAILED`: a rank of the other role that failed leaves its
    cause there (:meth:`report_failure`), and the reader raises it (:class:`PeerLeft`) instead of
    waiting out the store's timeout."""

    def __init__(
        self, store: dist.Store, secret: JobSecret, prefix: str = "rollout/", types: tuple[type, ...] = ()
    ) -> None:
        self.prefix, self.types, self.secret = prefix, types, secret
        self.store = dist.PrefixStore(prefix, store)
        self.port = _port_of(store)

    def _mac(self, key: str, payload: bytes) -> bytes:
        return self.secret.mac(DOMAIN, (self.prefix + key).encode(), payload)

    def seal(self, key: str, obj) -> bytes:
        """``obj`` as the signed value this Mailbox puts under ``key``."""
        payload = encode(obj, self.types)
        return SIGNED + self._mac(key, payload) + payload

    def open(self, key: str, value: bytes):
        """The object of a value read under ``key``: its signature checked first (a value not signed
        with this job's secret for this key raises :class:`ForgedMessage`), then decoded."""
        value = bytes(value)
        name = self.prefix + key
        if not value.startswith(SIGNED) or len(value) < len(SIGNED) + 32:
            if value.startswith(MAGIC):
                what = "a message of the wire format without one"
            elif value[:1] == b"\x80":
                what = "it looks like a pickle"
            else:
                what = f"{len(value)} bytes starting with {value[:8]!r}"
            raise self._forged(name, f"no signature; {what}")
        mac, payload = value[len(SIGNED) : len(SIGNED) + 32], value[len(SIGNED) + 32 :]
        if not hmac.compare_digest(mac, self._mac(key, payload)):
            why = "a wrong signature: another secret, or a message of another key copied here"
            raise self._forged(name, why)
        return decode(payload, self.types, key=name)

    def _forged(self, name: str, why: str) -> ForgedMessage:
        port = f" (port {self.port})" if self.port is not None else ""
        return ForgedMessage(
            f"the job's store holds a message under {name} that is not signed with this job's secret "
            f"({why}): something other than this job wrote to its store{port}; it was refused before "
            "decoding, nothing of it was run. Check who can reach the job's ports (docs/reliability.md, "
            "Security and ports)."
        )

    def put(self, key: str, obj) -> None:
        self.store.set(key, self.seal(key, obj))  # type: ignore[arg-type]  # the stub says str; bytes are kept as is

    def take(self, key: str, readers: int):
        """The value under ``key`` (waits for it, up to the store's timeout, unless a rank of the other
        role leaves first: :class:`PeerLeft`), checked and decoded by :meth:`open`; the last of
        ``readers`` deletes it."""
        obj = self.open(key, self._wait(key))
        if self.store.add(f"{key}#read", 1) == readers:
            self.store.delete_key(key)
            self.store.delete_key(f"{key}#read")
        return obj

    def _wait(self, key: str) -> bytes:
        # check() answers at once: store.wait() with a short timeout would log a warning at each timeout
        pause, timeout = POLL_S[0], self.store.timeout  # type: ignore[attr-defined]  # a property the stub lacks
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.store.check([key]):
            self.raise_if_peer_left()
            if time.monotonic() > deadline:
                ms = int(timeout.total_seconds() * 1000)
                raise dist.DistStoreError(f"wait timeout after {ms}ms, keys: {self.prefix}{key}")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        return self.store.get(key)

    def report_failure(self, rank: int, error: BaseException) -> None:
        """Leave ``error``, this rank's reason to leave, for the other role's readers (best effort: the
        error itself is what this rank raises)."""
        lines = str(error).splitlines() or [""]
        cause = lines[0] if isinstance(error, LaunchError) else f"{type(error).__name__}: {lines[0]}"
        try:
            self.put(FAILED, {"rank": rank, "cause": cause})
        except Exception:  # the store may be what failed
            log.warning("could not leave the cause of rank %d's failure in the job's store", rank)

    @contextlib.contextmanager
    def reporting_failure(self, rank: int) -> Iterator[None]:
        """A role server's loop inside: any failure but a peer's (:class:`PeerLeft`, which already said
        why) is left for the other role's readers (:meth:`report_failure`) and raised."""
        try:
            yield
        except PeerLeft:
            raise
        except Exception as e:
            self.report_failure(rank, e)
            raise

    @contextlib.contextmanager
    def peer_cause(self) -> Iterator[None]:
        """Inside: a failed process-group call between the two roles (a RuntimeError) is raised as the
        cause a rank of the other role left in the store (:meth:`raise_if_peer_left`), when it left one."""
        try:
            yield
        except RuntimeError:
            self.raise_if_peer_left()
            raise

    def raise_if_peer_left(self) -> None:
        """Raise :class:`PeerLeft` with the cause a failed rank left under :data:`FAILED`, if any."""
        if self.store.check([FAILED]):
            note = self.open(FAILED, self.store.get(FAILED))
            role = self.prefix.rstrip("/")
            raise PeerLeft(f"{role} rank {note['rank']} left: {note['cause']} ({COLLATERAL})")


def bridge_group(
    store: dist.Store, name: str, rank: int, size: int, backend: str, timeout: datetime.timedelta
):
    """A process group over ranks of two roles (``name``: its keys in the job's store), built directly
    on the job's store, since each role's torch.distributed world holds only its own ranks."""
    prefix = dist.PrefixStore(name, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefix, rank, size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(prefix, rank, size, timeout)


def pair_group(store: dist.Store, rank: int, size: int, backend: str, timeout: datetime.timedelta):
    """A group of a leader (rank 0) and another role's ranks (1..): the separate rollout's weights group."""
    return bridge_group(store, "rollout/weights-group", rank, size, backend, timeout)


def broadcast_root(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([tensor], opts).wait()
