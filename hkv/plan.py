"""`RestorePlan`: what a prefix lookup found and what it really restores, stage by stage."""

from __future__ import annotations

import dataclasses

import numpy as np

from .prefix import PLAN_FIELDS, STAGES, Reason
from .state import Status


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """A prefix hit as a restoration plan.

    hash_hit_tokens: the naive chained-hash match (what "hash hit equals reuse" would reuse).
    tokens_after_stage: tokens surviving each validation stage — lifecycle, abi, intersection, byte.
    restored_tokens: what was really restored (== tokens_after_stage["byte"] unless the claim failed).
    first_failed_stage: the first stage that shrank the plan ("hash" when the hash match itself
    ended before the prompt did), or None. reason: why ("collision", "freed", "page_reused",
    "abi_mismatch", "swa_missing", "tail_missing", "indexer_version", "checksum", "no_hash_match").
    recompute: [start, end) token range the engine computes.
    window_recomputed: when the SWA window / TAIL at the restored boundary was missing and rebuilding
    it was cheaper than recomputing the gap, the [L - R, L) tokens re-run (without sealing) to rebuild
    them; R = layers x (window - 1), the receptive field of the windows.
    disk_tokens: [L0, L1) tokens installed from the disk tier (verified before use), or None.
    """

    prompt_tokens: int
    hash_hit_tokens: int
    tokens_after_stage: dict
    restored_tokens: int
    first_failed_stage: str | None
    reason: str | None
    recompute: tuple[int, int]
    status: str = "OK"
    window_recomputed: tuple[int, int] | None = None
    disk_tokens: tuple[int, int] | None = None

    @classmethod
    def from_vector(cls, vec, block_tokens: int, prompt_tokens: int) -> "RestorePlan":
        v = dict(zip(PLAN_FIELDS, np.asarray(vec).tolist()))
        after = {name: v[f"{name}_blocks"] * block_tokens for name in STAGES[1:]}
        stage = None if v["first_failed_stage"] < 0 else STAGES[v["first_failed_stage"]]
        reason = None if v["reason"] == Reason.NONE else Reason(v["reason"]).name.lower()
        restored = v["byte_blocks"] * block_tokens
        return cls(
            prompt_tokens=prompt_tokens,
            hash_hit_tokens=v["hash_blocks"] * block_tokens,
            tokens_after_stage=after,
            restored_tokens=restored,
            first_failed_stage=stage,
            reason=reason,
            recompute=(restored, prompt_tokens),
            status=Status(v["status"]).name,
        )

    @classmethod
    def cold(cls, prompt_tokens: int) -> "RestorePlan":
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
