"""Block keys for prefix reuse: a chained blake2b-128 over (parent key, block token ids, extra keys).

Computed on the host. `extra` carries anything that must separate two caches of the same tokens
(an adapter id, a per-tenant cache salt). The key says *which content*; whether a cached block can be
used by the running engine (weights, dtypes, kernel layout — the ABI fingerprint) is validated
separately at restore time (stage 2), so an ABI change is reported as such rather than as a silent
miss. A key collision cannot produce wrong output: the prefix index keeps each block's token ids and
its parent record and rejects a block whose tokens or chain differ (stage 1, reason `collision`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT = bytes(16)


def chain_keys(tokens: Sequence[int], block_tokens: int, extra: bytes = b"", parent: bytes = ROOT) -> list[bytes]:
    """16-byte keys of every FULL block of `tokens`: key_i = blake2b(key_{i-1} | len(extra) | extra | ids_i)."""
    if block_tokens < 1:
        raise ValueError(f"{block_tokens=} must be >= 1")
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence; got shape {ids.shape}")
    out, key = [], parent
    salt = len(extra).to_bytes(4, "little") + extra
    for i in range(len(ids) // block_tokens):
        block = ids[i * block_tokens : (i + 1) * block_tokens].astype("<i8").tobytes()
        key = hashlib.blake2b(key + salt + block, digest_size=16).digest()
        out.append(key)
    return out


def key_words(key: bytes) -> np.ndarray:
    """A 16-byte key as uint32[4] (how the device-side prefix index stores it)."""
    if len(key) != 16:
        raise ValueError(f"key of {len(key)} bytes; block keys are 16 bytes")
    return np.frombuffer(key, dtype="<u4").astype(np.uint32)


def key_bytes(words) -> bytes:
    """uint32[4] words (as the device-side prefix index stores a key) back to the 16-byte key."""
    return np.asarray(words, dtype="<u4").tobytes()


def next_key(parent: bytes, block: Sequence[int], extra: bytes = b"") -> bytes:
    """The key of one more block after `parent` (same chain as `chain_keys`)."""
    return chain_keys(block, len(block), extra=extra, parent=parent)[0]
