"""Every random stream of a run, derived from one hash: ``derive(stream, key, ...)``.

A stream is named for what it draws and keyed by the config's seed and the indices that tell its
draws apart. blake2b over the stream's name and its packed key gives 8 bytes, folded to ``bits``: two
keys, or two streams at equal keys, share a seed only by chance (about 2**-63 a pair at 63 bits),
never by construction as a sum of strided terms does (with ``seed*A + step*B + row``, row B of step s
is row 0 of step s+1).

=================  ==================================================  =====================================
stream             key                                                 draws
=================  ==================================================  =====================================
``SAMPLE``         rollout.seed, step, dp_rank, row, validate          one response's tokens (each turn of
                                                                       an episode, of the agent loop or
                                                                       the OpenAI endpoint: its own row)
``ENGINE_CALL``    the engine's seed, call number                      a call without rollout.seed
``DATA_ORDER``     data.seed, epoch                                    the training prompts' order
``UPDATE_ORDER``   global step, update epoch                           the mini-batch order (``*.shuffle``)
``CLIP_COV``       global step, dp_rank                                clip_cov's tokens
``ROUNDING``       megatron.seed, optimizer key, optimizer step        stochastic rounding's noise
``LORA_INIT``      megatron.seed, lora key, parameter's global name    one LoRA A matrix (no layout moves it)
=================  ==================================================  =====================================

Two streams are not ours and keep their owners' formulas: megatron-core's model-parallel RNG (weight
init and dropout, seeded by ``*.megatron.seed`` in :func:`megatron_rl.parallel.seed_all`) and verl's
bootstrap draws for validation metrics (numpy seeded with 42 before each draw, as verl does).
"""

from __future__ import annotations

import hashlib

SAMPLE = "rollout/sample"
ENGINE_CALL = "rollout/engine_call"
DATA_ORDER = "data/order"
UPDATE_ORDER = "update/order"
CLIP_COV = "update/clip_cov"
ROUNDING = "optim/rounding"
LORA_INIT = "lora/init"

BITS = 63
"""The widest range: [0, 2**63), what ``torch.Generator.manual_seed`` takes as a non-negative int64."""


def derive(stream: str, *key: int | bool | str, bits: int = BITS) -> int:
    """The seed of ``stream`` at ``key`` in [0, 2**bits) (the module docstring lists the streams).
    Integers are taken modulo 2**64 (any Python int packs); strings by their UTF-8 bytes."""
    if not 1 <= bits <= BITS:
        raise ValueError(f"bits={bits} must be in [1, {BITS}]")
    h = hashlib.blake2b(digest_size=8, person=b"megatron-rl")
    for part in (stream, *key):
        if isinstance(part, str):  # length-prefixed: ("ab", "c") and ("a", "bc") differ
            raw = part.encode()
            h.update(b"s" + len(raw).to_bytes(4, "little") + raw)
        else:
            h.update(b"i" + (int(part) & (2**64 - 1)).to_bytes(8, "little"))
    value = int.from_bytes(h.digest(), "little")
    value ^= value >> bits  # fold the high bits in rather than dropping them
    return value & ((1 << bits) - 1)
