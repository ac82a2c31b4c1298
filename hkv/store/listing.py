"""Incremental, bounded listings of a disk tier store for the whole-store operations (`verify`, `stats`,
the evictor's ranking); never on the lookup path, which reads computed keys only.

A kvstore LIST returns every key of its range at once, so the key space is cut into contiguous ranges
listed one after another (`key_ranges`): one per ABI directory the usage ledger names, split into 16
or 256 sub-ranges by the first hex digits of the segment name (random: a new segment's name starts with
8 random hex digits) when the ledger counts more segments there than one page should hold, plus the
gaps between them (where stray files and ABIs the ledger does not know are still found). A range's
keys are then handled in pages of at most `page_keys` (`manifest_pages`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import tensorstore as ts

from . import manifest as mf
from .blocks import MALFORMED
from .context import Rejection, TierContext, manifest_where
from .coord import Usage, read_usage

PAGE_KEYS = 1000  # names handled (and manifests read) at once


def key_ranges(prefix: str, usage: Usage, page_keys: int = PAGE_KEYS) -> list[tuple[str, str]]:
    """Contiguous key ranges that cover every key under `prefix` (`manifests/` or `data/`).

    Args:
        prefix: a top folder of the store, ending in '/'.
        usage: the ledger (its ABIs and their segment counts choose the cut).
        page_keys: the keys one range should hold at most (for ABIs the ledger knows).
    Returns:
        [(inclusive min, exclusive max)] in key order, together covering [prefix, prefix end).
    Raises:
        ValueError: a prefix that does not end in '/' or a page_keys below 1.
    """
    if not prefix.endswith("/") or page_keys < 1:
        raise ValueError(f"prefix={prefix!r} must end in '/' and page_keys={page_keys} be >= 1")
    end = prefix[:-1] + "0"  # '0' follows '/'
    ranges, cur = [], prefix
    for abi in sorted(usage.abis):
        p = f"{prefix}{abi}/"
        if cur < p:
            ranges.append((cur, p))
        n = usage.abis[abi][0]
        digits = 0 if n <= page_keys else 1 if n <= 16 * page_keys else 2
        cuts = [p] + [p + f"{i:0{digits}x}" for i in range(1, 16**digits)] + [p[:-1] + "0"]
        ranges += list(itertools.pairwise(cuts))
        cur = p[:-1] + "0"
    ranges.append((cur, end))
    return ranges


def listed_keys(ctx: TierContext, prefix: str, usage: Usage | None = None) -> Iterator[list[str]]:
    """The keys under `prefix`, one range (`key_ranges`) at a time.

    Args:
        ctx: the tier's shared state.
        prefix: `manifests/` or `data/`.
        usage: the ledger (None: read it now).
    Yields:
        The keys of one range (decoded), in no particular order.
    """
    usage = read_usage(ctx) if usage is None else usage
    for lo, hi in key_ranges(prefix, usage):
        keys = ctx.kv.list(ts.KvStore.KeyRange(lo, hi)).result()
        if keys:
            yield [k.decode(errors="replace") for k in keys]


@dataclasses.dataclass
class Scanned:
    """One manifest as a listing found it: its key, (abi, segment) from its name, and either its checked
    fields and size, or why it was refused."""

    key: str
    sid: tuple[str, str] | None
    doc: dict | None = None
    raw_bytes: int = 0
    rejection: Rejection | None = None


def manifest_pages(ctx: TierContext, usage: Usage | None = None, page_keys: int = PAGE_KEYS) -> Iterator[list[Scanned]]:
    """Every `.json` key under `manifests/`, read (bounded) and checked, a page at a time. Only one
    page's manifests are in memory at once. A missing manifest (deleted since it was listed) is left
    out; an unreadable, misnamed or refused one is a `Scanned` with its rejection.

    Args:
        ctx: the tier's shared state.
        usage: the ledger (None: read it now).
        page_keys: manifests read at once.
    Yields:
        Pages of `Scanned`.
    """
    for keys in listed_keys(ctx, "manifests/", usage):
        keys = sorted(k for k in keys if k.endswith(".json"))
        for i in range(0, len(keys), page_keys):
            yield _page(ctx, keys[i : i + page_keys])


def _page(ctx: TierContext, keys: list[str]) -> list[Scanned]:
    """Read and check the manifests `keys` (bounded reads issued at once)."""
    out, where = [], {}
    for k in keys:
        w = manifest_where(k)
        if w is None:
            out.append(
                Scanned(
                    k,
                    None,
                    rejection=Rejection(MALFORMED, "not a manifest name (manifests/<32 hex abi>/<segment>.json)"),
                )
            )
        else:
            where[k] = w
    for k, (raw, why) in ctx.read_bounded(list(where), mf.MAX_MANIFEST_BYTES).items():
        if raw is None:
            if why is not None:
                out.append(Scanned(k, where[k], rejection=Rejection(MALFORMED, why)))
            continue
        try:
            doc = mf.parse(raw, key=ctx.key, abi=where[k][0], segment=where[k][1], max_data_bytes=ctx.budget_bytes)
        except mf.ManifestError as e:
            out.append(Scanned(k, where[k], rejection=Rejection(e.reason, str(e))))
            continue
        out.append(Scanned(k, where[k], doc=doc, raw_bytes=len(raw)))
    return out
