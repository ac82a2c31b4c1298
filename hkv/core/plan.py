"""What a prefix lookup found and what it really restores, stage by stage, and by which route.

`DevicePlan` is the result of `hkv.core.prefix.restore` on device (int32 scalars, a pytree that jit
returns); `RestorePlan` is its host form with the prompt's token counts, what `Generation.plan` holds.
The routes past the device hit (install blocks from the disk tier, rebuild the sliding window) extend
a plan through the pure functions here (`extend_with_disk`, `with_window_rebuilt`, `started_cold`),
and the choice between routes weighs a typed estimate (`RestoreCosts`, from `MeasuredCosts`).
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


ROUTES = ("shrink", "window", "disk")  # recompute from the device hit; rebuild the window; read the disk


@dataclasses.dataclass
class MeasuredCosts:
    """Seconds measured as an engine runs (exponential moving averages, weight 0.2 on each new sample).

    Attributes:
      chunk: one prefill step of the full chunk width (None until measured).
      narrow: one prefill step of each narrower width (prefill buckets), by width.
      disk_token: installing one token from the disk tier (read, verify, swap in).
      via_prefill: one token decoded through the prefill step while the decode step builds.
      window: one window rebuild (`hkv.core.prefix.restore_window`: the restore and the model step
        over R tokens, read back on the host), from the second sample on: the first may be the
        step's first run in the process, which costs several times a later one.
      window_runs: window rebuild samples offered (the first one included).
    """

    chunk: float | None = None
    narrow: dict[int, float] = dataclasses.field(default_factory=dict)
    disk_token: float | None = None
    via_prefill: float | None = None
    window: float | None = None
    window_runs: int = 0

    def measure(self, what: str, seconds: float, width: int | None = None) -> None:
        """Fold one sample in. what: "chunk" (with `width` for a narrower step), "disk_token",
        "via_prefill" or "window" (whose first sample is counted, not kept)."""
        if what not in ("chunk", "disk_token", "via_prefill", "window"):
            raise ValueError(f"what={what!r} must be 'chunk', 'disk_token', 'via_prefill' or 'window'")
        if what == "window":
            self.window_runs += 1
            if self.window_runs == 1:
                return

        def mix(old: float | None) -> float:
            return seconds if old is None else 0.8 * old + 0.2 * seconds

        if what == "chunk" and width is not None:
            self.narrow[width] = mix(self.narrow.get(width))
        else:
            setattr(self, what, mix(getattr(self, what)))


@dataclasses.dataclass(frozen=True)
class RouteReach:
    """Where each route to a prompt's end restores up to (tokens): recompute from the device hit
    ("shrink"), rebuild the window at the ABI-stage boundary ("window"), install from disk ("disk")."""

    shrink: int
    window: int
    disk: int


@dataclasses.dataclass(frozen=True)
class RestoreCosts:
    """Estimated seconds to reach a prompt's end by each route; None where the route is not offered."""

    shrink: float
    window: float | None = None
    disk: float | None = None

    def offered(self) -> dict[str, float]:
        """{route: seconds} of the routes offered, in `ROUTES` order."""
        return {r: getattr(self, r) for r in ROUTES if getattr(self, r) is not None}

    def choose(self, rule: str, reach: RouteReach) -> str:
        """The route to take. rule "cheapest": the least estimated time; "longest": the route that
        restores the most tokens (ties: the cheaper), whatever the timings."""
        offered = self.offered()
        if rule == "longest":
            return max(offered, key=lambda k: (getattr(reach, k), -offered[k]))
        if rule == "cheapest":
            return min(offered, key=offered.get)
        raise ValueError(f"rule={rule!r} must be 'cheapest' or 'longest'")


def estimate_restore_costs(
    measured: MeasuredCosts,
    *,
    chunk: int,
    widths: tuple[int, ...],
    window_tokens: int,
    prompt: int,
    l0: int,
    window_at: int | None,
    disk_at: int,
) -> RestoreCosts:
    """Estimated seconds to reach the prompt's end from each route: recompute from `l0` ("shrink"),
    rebuild the window at `window_at` ("window", offered when not None), or install [l0, disk_at) from
    disk ("disk", offered when disk_at > l0). Until measured, a chunk costs 1 s, a narrower step its
    share of one, a window rebuild its R tokens' share of a chunk, and a disk token a tenth of a
    prefilled token (the case for any real model: reading a block moves bytes, recomputing it runs
    every layer). Once measured, a window rebuild costs what it took (the restore, the R-token step
    and the read-back: more than R tokens' share of a chunk on a small model).

    Args:
      measured: the engine's measured costs.
      chunk: the prefill chunk width; widths: every prefill width, ascending, the last `chunk`.
      window_tokens: tokens one window rebuild runs (`hkv.core.policy.window_rebuild_tokens`).
      prompt: the prompt's tokens; l0: tokens the device restored.
    Returns:
      a `RestoreCosts`.
    """
    per_chunk = measured.chunk or 1.0
    disk_tok = measured.disk_token if measured.disk_token is not None else 0.1 * per_chunk / chunk
    rebuild = measured.window if measured.window is not None else window_tokens / chunk * per_chunk

    def compute(n: int) -> float:
        """Full chunks, then the narrowest width holding the rest (measured, else pro rata)."""
        full, rest = divmod(max(n, 0), chunk)
        if not rest:
            return full * per_chunk
        w = next(w for w in widths if w >= rest)
        last = measured.narrow.get(w) if w < chunk else per_chunk
        return full * per_chunk + (last if last is not None else per_chunk * w / chunk)

    return RestoreCosts(
        shrink=compute(prompt - l0),
        # one step over exactly R tokens (not padded to a chunk), then the chunks after window_at
        window=None if window_at is None else rebuild + compute(prompt - window_at),
        disk=(disk_at - l0) * disk_tok + compute(prompt - disk_at) if disk_at > l0 else None,
    )


@dataclasses.dataclass(frozen=True)
class DiskStage:
    """What the disk tier offers past the device-restored prefix, and what was installed from it.

    Attributes:
      found: tokens up to the end of the stored chain (blocks the tier's index lists, not yet read).
      snapshot_end: tokens up to the last stored block ending in an SWA + TAIL snapshot (l0 if none).
      installed: tokens restored once the disk blocks were read, verified and installed (l0 if none).
      reason: why the disk route stopped short (a `Reason` value such as "disk_checksum"), or None.
    """

    found: int
    snapshot_end: int
    installed: int
    reason: str | None = None


def extend_with_disk(
    plan: RestorePlan, vec: DevicePlan, stage: DiskStage, block_tokens: int
) -> tuple[RestorePlan, DevicePlan]:
    """The plan after the disk stage: the device-restored prefix [0, L0) extended to
    `stage.installed`; the hash hit and per-stage tokens at least what the disk's index found; the
    failed stage and reason those of the disk when it stopped short. `vec` (the host `DevicePlan`)
    is updated to match, for the device counters (`count_plan`). Unchanged when nothing was
    installed and nothing went wrong.

    Args:
      plan, vec: the device lookup's plan (host form and `DevicePlan.host()`).
      stage: the disk stage's outcome.
      block_tokens: tokens per block.
    Returns:
      (plan, vec).
    """
    bt, l0, l1 = block_tokens, plan.restored_tokens, stage.installed
    if l1 == l0 and stage.reason is None:
        return plan, vec
    floor = {"lifecycle": stage.found, "abi": stage.found, "intersection": stage.snapshot_end, "byte": l1}
    after = {k: max(v, floor[k]) for k, v in plan.tokens_after_stage.items()}
    hash_hit = max(plan.hash_hit_tokens, stage.found)
    if l1 >= hash_hit and stage.reason is None:
        failed, why = None, None
    elif stage.reason is not None:  # (also when the index refused what lies past the hit: a bad pointer)
        why = Reason(stage.reason)
        failed = why.stage
    else:
        failed, why = plan.first_failed_stage, plan.reason
    vec = vec.replace(
        hash_blocks=hash_hit // bt,
        byte_blocks=l1 // bt,
        disk_blocks=(l1 - l0) // bt,
        reason=Reason(why).code if why else 0,
        first_failed_stage=STAGES.index(failed) if failed else -1,
    )
    plan = dataclasses.replace(
        plan,
        hash_hit_tokens=hash_hit,
        tokens_after_stage=after,
        restored_tokens=l1,
        first_failed_stage=failed,
        reason=why,
        recompute=(l1, plan.prompt_tokens),
        disk_tokens=(l0, l1) if l1 > l0 else None,
    )
    return plan, vec


def with_window_rebuilt(plan: RestorePlan, window_tokens: int) -> RestorePlan:
    """A window-rebuild restore's plan: its last `window_tokens` restored tokens were re-run to rebuild
    the sliding window and TAIL (`RestorePlan.window_recomputed`)."""
    end = plan.restored_tokens
    return dataclasses.replace(plan, window_recomputed=(end - window_tokens, end))


def started_cold(plan: RestorePlan, vec: DevicePlan) -> tuple[RestorePlan, DevicePlan]:
    """The plan of a request restarted cold after a route failed to map its pages: nothing restored,
    everything computed; `vec` counts no restored block."""
    return (
        dataclasses.replace(plan, restored_tokens=0, recompute=(0, plan.prompt_tokens)),
        vec.replace(byte_blocks=0),
    )


__all__ = [
    "ROUTES",
    "DevicePlan",
    "DiskStage",
    "MeasuredCosts",
    "RestoreCosts",
    "RestorePlan",
    "RouteReach",
    "estimate_restore_costs",
    "extend_with_disk",
    "started_cold",
    "with_window_rebuilt",
]
