"""What a prefix lookup found and what it really restores, stage by stage.

`DevicePlan` is the result of `hkv.core.prefix.restore` on device (int32 scalars, a pytree that jit
returns); `RestorePlan` is its host form with the prompt's token counts, what `Generation.plan` holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from .layout import Status
from .reasons import STAGES, Reason


@struct.dataclass
class DevicePlan:
    """A restore's outcome on device: every field an int32 scalar (or numpy int after `jax.device_get`).

    Attributes:
      hash_blocks: blocks the chained block hash matched.
      lifecycle_blocks, abi_blocks, intersection_blocks, byte_blocks: blocks surviving each validation
        stage; `byte_blocks` is what the claim restored (0 when the claim failed).
      first_failed_stage: index into `STAGES` of the first stage that shrank the plan, -1 for none.
      reason: `Reason.code` of why (0 = none).
      status: `Status` of the claim (OK, NO_PAGES, SLOT_INACTIVE).
      record: the prefix record the slot now extends (-1 = none).
      disk_blocks: blocks installed from the disk tier (set by the engine).
    """

    hash_blocks: jax.Array
    lifecycle_blocks: jax.Array
    abi_blocks: jax.Array
    intersection_blocks: jax.Array
    byte_blocks: jax.Array
    first_failed_stage: jax.Array
    reason: jax.Array
    status: jax.Array
    record: jax.Array
    disk_blocks: jax.Array

    @classmethod
    def make(cls, **fields) -> DevicePlan:
        """A plan from int-like fields (missing ones: 0, `first_failed_stage` and `record` -1)."""
        full = dict(first_failed_stage=-1, record=-1)
        full.update(fields)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(full) - set(names)
        if unknown:
            raise ValueError(f"unknown DevicePlan fields {sorted(unknown)}; allowed: {names}")
        return cls(**{n: jnp.asarray(full.get(n, 0), jnp.int32) for n in names})

    def host(self) -> DevicePlan:
        """The same plan with plain Python ints (one device-to-host transfer)."""
        return jax.tree.map(int, jax.device_get(self))

    @classmethod
    def miss(cls, n_blocks: int) -> DevicePlan:
        """What `restore` returns on a freshly claimed slot when no record is a chain root with the
        lookup's first block key (an empty index, for one; `hkv.core.prefix.could_match`), for a
        lookup allowing `n_blocks` blocks: nothing matched (stage "hash", NO_HASH_MATCH, unless no
        block was allowed), status OK, no record. Plain Python ints, as `host()` gives."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks={n_blocks}: a lookup allows 0 or more blocks")
        names = [f.name for f in dataclasses.fields(cls)]
        fields = dict.fromkeys(names, 0)
        fields.update(
            first_failed_stage=0 if n_blocks else -1,
            reason=Reason.NO_HASH_MATCH.code if n_blocks else 0,
            status=int(Status.OK),
            record=-1,
        )
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """A prefix hit as a restoration plan.

    hash_hit_tokens: the naive chained-hash match (what "hash hit equals reuse" would reuse).
    tokens_after_stage: tokens surviving each validation stage — lifecycle, abi, intersection, byte.
    restored_tokens: what was really restored (== tokens_after_stage["byte"] unless the claim failed).
    first_failed_stage: the first stage that shrank the plan ("hash" when the hash match itself
    ended before the prompt did), or None. reason: why, a `Reason` (a str: "collision", "freed",
    "swa_missing", "disk_checksum", ...) or None.
    recompute: [start, end) token range the engine computes.
    window_recomputed: when the SWA window / TAIL at the restored boundary was missing and rebuilding
    it was cheaper than recomputing the gap, the [L - R, L) tokens re-run (without sealing) to rebuild
    them; R = layers x (window - 1), the receptive field of the windows.
    disk_tokens: [L0, L1) tokens installed from the disk tier (verified before use), or None.
    shard: the data shard of an `hkv.MeshEngine` that served the request (its router's choice), or
    None on a single-device `hkv.Engine`.
    """

    prompt_tokens: int
    hash_hit_tokens: int
    tokens_after_stage: dict
    restored_tokens: int
    first_failed_stage: str | None
    reason: Reason | None
    recompute: tuple[int, int]
    status: str = "OK"
    window_recomputed: tuple[int, int] | None = None
    disk_tokens: tuple[int, int] | None = None
    shard: int | None = None

    @classmethod
    def from_device(cls, plan: DevicePlan, block_tokens: int, prompt_tokens: int) -> RestorePlan:
        """The host plan of a `DevicePlan` for a prompt of `prompt_tokens` tokens."""
        p = plan.host()
        after = {name: getattr(p, f"{name}_blocks") * block_tokens for name in STAGES[1:]}
        stage = None if p.first_failed_stage < 0 else STAGES[p.first_failed_stage]
        restored = p.byte_blocks * block_tokens
        return cls(
            prompt_tokens=prompt_tokens,
            hash_hit_tokens=p.hash_blocks * block_tokens,
            tokens_after_stage=after,
            restored_tokens=restored,
            first_failed_stage=stage,
            reason=Reason.from_code(p.reason),
            recompute=(restored, prompt_tokens),
            status=Status(p.status).name,
        )

    @classmethod
    def cold(cls, prompt_tokens: int) -> RestorePlan:
        """No prefix cache: nothing looked up, everything computed."""
        return cls(
            prompt_tokens=prompt_tokens,
            hash_hit_tokens=0,
            tokens_after_stage=dict.fromkeys(STAGES[1:], 0),
            restored_tokens=0,
            first_failed_stage=None,
            reason=None,
            recompute=(0, prompt_tokens),
        )


__all__ = ["DevicePlan", "RestorePlan"]
