"""`TieredStore`: a `HostTier` over a `DiskTier`, used by the engine as one prefix tier (`disk=`).

    engine = hkv.Engine(model, config, disk=hkv.TieredStore(hkv.HostTier(8 << 30), hkv.DiskTier(path)))

Lookups: `find_chain` asks the host tier first and the disk tier for the rest of the chain (from the
first block the host lacks). The chain's disk blocks are then *prefetched*: read from disk (verified)
and promoted into the host tier in the background, in chain order, in pieces of `prefetch_blocks`
blocks doubling in size. A
`read` waits only for the prefetch pieces holding the blocks it asks for, so the engine installs the
first blocks while the later ones are still loading, and a later request for the longer chain finds
them in host memory.

Reads: host blocks are verified by the host tier (digests), disk blocks by the disk tier (manifests,
crc32c, sum64, HMAC); a disk block read is promoted into the host tier (promotion on hit). A host
block evicted between the lookup and the read is looked up again on disk, so a read never fails
because a block moved down a tier. Faults keep the disk tier's reasons (`disk_missing`,
`disk_checksum`, ...): a damaged block in either tier is a shorter plan with its reason.

Writes land in the host tier (`write_async` resolves at once). Over its budget it evicts leaves
first, least recently used first; an evicted block the disk tier lacks is written there
(write-behind, one `DiskTier.write_async` per eviction pass and ABI) and stays readable in host
memory until that write is published. `close()` writes every block the disk tier lacks before closing
both tiers (`close(persist=False)` skips that).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from .blocks import MISSING, BlockPayload, BlockRef, ChainLookup, ReadResult
from .host import HOST_SEGMENT, HostTier, mismatch
from .tier import DiskTier, DiskTierClosedError

MAX_PIECE = 512  # blocks read by one prefetch piece at most
Expect = Callable[[BlockRef], dict[str, tuple[np.dtype, tuple]]]


def _done(value=None, error: BaseException | None = None) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
    return fut


def _ref_id(ref: BlockRef) -> tuple[str, str, str, bool]:
    return ref.abi, ref.segment, ref.entry["key"], bool(ref.entry["snapshot"])


def _key(ref: BlockRef) -> bytes:
    """The block key a ref was found by (a keyed store's entry holds only its keyed hash)."""
    return ref.raw_key if ref.raw_key is not None else bytes.fromhex(ref.entry["key"])


@dataclasses.dataclass(eq=False)
class Piece:
    """A prefetch piece: disk refs read together (`read` resolves to their `ReadResult`), then
    promoted into host memory (`promoted`, set once the read verified some)."""

    refs: list[BlockRef]
    read: concurrent.futures.Future | None = None
    promoted: concurrent.futures.Future | None = None


class TieredStore:
    """A host-memory tier over a disk tier (see the module docstring).

    Args:
        host: the host tier (its `spill` is set to write to `disk`).
        disk: the disk tier below.
        prefetch_blocks: disk blocks in the first prefetch piece of a chain (each next piece doubles,
            up to `MAX_PIECE`); 0 turns prefetching off (a disk block then enters host memory only
            when it is read).

    Attributes: `host`, `disk`, `prefetch_blocks`, `spec` ("host+" the disk tier's spec).
    """

    def __init__(self, host: HostTier, disk: DiskTier, *, prefetch_blocks: int = 16):
        if not isinstance(host, HostTier):
            raise ValueError(f"host={host!r} must be an hkv.HostTier")
        if not isinstance(disk, DiskTier):
            raise ValueError(f"disk={disk!r} must be an hkv.DiskTier")
        if not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
            raise ValueError(f"{prefetch_blocks=} must be an integer >= 0")
        self.host, self.disk, self.prefetch_blocks = host, disk, prefetch_blocks
        host.spill = self._spill
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, str, str, bool], tuple[Piece, int]] = {}  # ref -> (its piece, position)
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hkv-prefetch-read")
        self._promoter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hkv-promote")
        self._closed = False
        self.prefetched = 0  # disk blocks promoted by prefetching

    # ------------------------------------------------------------------------------ state
    @property
    def spec(self) -> str:
        """ "host+" and the disk tier's kvstore spec (for messages)."""
        return f"host+{self.disk.spec!r}"

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    @property
    def counters(self) -> dict[str, int]:
        """The disk tier's counters, and the host tier's prefixed "host_" (plus "host_prefetched")."""
        return {
            **self.disk.counters,
            **{f"host_{k}": v for k, v in self.host.counters.items()},
            "host_prefetched": self.prefetched,
        }

    def stored_bytes(self) -> int:
        """Bytes both tiers hold (host objects + the disk tier's stored bytes)."""
        return self.host.stored_bytes() + self.disk.stored_bytes()

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise DiskTierClosedError(f"TieredStore.{op}: this TieredStore was closed; build a new one")

    def contains(self, abi: str, key: bytes) -> tuple[bool, bool]:
        """(held in either tier, held with a snapshot in either) for block `key` under `abi`.

        Args:
            abi: the ABI fingerprint.
            key: the engine's block key.
        Returns:
            (stored, stored with a snapshot).
        """
        held, snap = self.host.contains(abi, key)
        if snap:
            return held, snap
        stored, with_snap = self.disk.contains(abi, key)
        return held or stored, with_snap

    # ----------------------------------------------------------------------------- lookup
    def find_chain(self, abi: str, keys: list[bytes], tokens: list[list[int]], start: int = 0) -> ChainLookup:
        """The host tier's chain from `start`, continued by the disk tier's from the first block the
        host lacks (`DiskTier.find_chain`); the disk part is prefetched into host memory.

        Args:
            abi: the ABI fingerprint.
            keys: the prompt's block keys.
            tokens: the token ids of each block.
            start: the first block looked up.
        Returns:
            A `ChainLookup`: host refs first (segment `HOST_SEGMENT`), then disk refs; `stop` as the
            last tier asked says.
        """
        self._check_open("find_chain")
        h = self.host.find_chain(abi, keys, tokens, start)
        if h.stop is None:
            return h
        d = self.disk.find_chain(abi, keys, tokens, start + len(h.refs))
        self.prefetch(d.refs)
        return ChainLookup(h.refs + d.refs, d.stop if d.refs or d.stop != "absent" else h.stop)

    def prefetch(self, refs: list[BlockRef]) -> int:
        """Read the disk blocks `refs` into the host tier in the background, in order, in pieces of
        `prefetch_blocks`, then twice as many each time (at most `MAX_PIECE`); blocks held in host or
        already loading are skipped. One thread reads the pieces (verified by the disk tier; the reads
        count as its reads and hits), another copies what verified into host memory, so a `read`
        waiting for a piece waits for its disk read only. Best effort: a piece that fails promotes its
        verified leading blocks, and a read of the failing block gets the disk tier's reason.

        Args:
            refs: disk refs from `DiskTier.find_chain`, in chain order.
        Returns:
            The blocks queued.
        """
        if not self.prefetch_blocks or self._closed:
            return 0
        with self._lock:
            todo = [
                r
                for r in refs
                if r.segment != HOST_SEGMENT
                and _ref_id(r) not in self._loading
                and not self.host.holds(r.abi, _key(r), r.snapshot)
            ]
            i, n = 0, self.prefetch_blocks
            while i < len(todo):  # pieces double in size: the first blocks come soon, the rest in large reads
                piece = Piece(todo[i : i + n])
                piece.read = self._reader.submit(self._load, piece)
                for pos, r in enumerate(piece.refs):
                    self._loading[_ref_id(r)] = (piece, pos)
                i, n = i + n, min(2 * n, MAX_PIECE)
        return len(todo)

    def _load(self, piece: Piece) -> ReadResult:
        """One prefetch piece's disk read; hands what verified to the promoting thread (never raises)."""
        try:
            res = self.disk.read(piece.refs)
        except Exception as e:  # a store that fails to answer: the read that needs these blocks asks again
            res = ReadResult([], MISSING, f"prefetch: {type(e).__name__}: {e}")
        if res.payloads:
            try:
                piece.promoted = self._promoter.submit(self._promote, piece.refs[0].abi, res.payloads, piece)
            except RuntimeError:  # closing: nothing is promoted
                self._forget(piece)
        else:
            self._forget(piece)
        return res

    def _promote(self, abi: str, payloads: list[BlockPayload], piece: Piece | None = None) -> None:
        """Copy verified disk blocks into the host tier (never raises)."""
        try:
            self.host.put(abi, payloads, clean=True)
            with self._lock:
                self.prefetched += len(payloads) if piece is not None else 0
        except Exception:  # a closed host tier: nothing to promote into
            pass
        finally:
            if piece is not None:
                self._forget(piece)

    def _forget(self, piece: Piece) -> None:
        with self._lock:
            for r in piece.refs:
                if self._loading.get(_ref_id(r), (None,))[0] is piece:
                    del self._loading[_ref_id(r)]

    def wait_prefetch(self, refs: list[BlockRef] | None = None, timeout: float | None = None) -> None:
        """Wait for the prefetch pieces holding `refs` (None: every piece queued) to be read and
        promoted into host memory.

        Args:
            refs: refs from `find_chain` (None: all).
            timeout: seconds at most per wait (None: no limit).
        """
        with self._lock:
            found = [self._loading.get(_ref_id(r)) for r in refs] if refs is not None else self._loading.values()
            pieces = {id(e[0]): e[0] for e in found if e is not None}.values()
        concurrent.futures.wait([p.read for p in pieces], timeout)
        concurrent.futures.wait([p.promoted for p in pieces if p.promoted is not None], timeout)

    # ------------------------------------------------------------------------------- read
    def read(self, refs: list[BlockRef], expect: Expect | None = None, count: bool = True) -> ReadResult:
        """Read and verify `refs` (in order; `DiskTier.read`): host blocks by the host tier; disk
        blocks from their prefetch piece (waiting for its disk read only), from host memory once
        promoted, else by the disk tier (then promoted into host memory in the background). Returns
        the leading verified blocks and the reason the next one failed.

        Args:
            refs: refs from `find_chain`.
            expect: `BlockRef` -> {object name: (dtype, shape)} the running engine needs for it.
            count: False: no hit or rejection is counted.
        Returns:
            A `ReadResult`.
        """
        self._check_open("read")
        n = next((i for i, r in enumerate(refs) if r.segment != HOST_SEGMENT), len(refs))
        res = self.host.read(refs[:n], expect, count)
        out = list(res.payloads)
        if res.reason == MISSING:  # evicted from host memory since the lookup: the disk tier may hold it
            want = refs[len(out) :]
            rest = self._relookup(want)
            if not rest:
                return res
            d = self._from_disk(out, rest, expect, count)
            if d.reason is None and len(rest) < len(want):
                return ReadResult(d.payloads, MISSING, f"host tier: block {want[len(rest)].entry['index']} is gone")
            return d
        if res.reason is not None:
            return res
        for j in range(n, len(refs)):
            payload, reason, detail = self._prefetched(refs[j], expect, count)
            if reason is not None:
                return ReadResult(out, reason, detail)
            if payload is None:
                return self._from_disk(out, refs[j:], expect, count)
            out.append(payload)
        return ReadResult(out)

    def _prefetched(
        self, ref: BlockRef, expect: Expect | None, count: bool
    ) -> tuple[BlockPayload | None, str | None, str]:
        """Disk block `ref` from its prefetch piece or from host memory: (payload, None, "") when there
        and verified, (None, reason, detail) when that copy fails, (None, None, "") when neither has it
        or the prefetched copy is not what `expect` needs (the disk tier's own read then refuses it,
        counted, with its reason)."""
        with self._lock:
            got = self._loading.get(_ref_id(ref))
        if got is not None:
            piece, pos = got
            res = piece.read.result()
            if pos < len(res.payloads):
                usable = mismatch(ref, res.payloads[pos].objects, expect) is None
                return (res.payloads[pos], None, "") if usable else (None, None, "")
            if pos == len(res.payloads) and res.reason is not None and not res.detail.startswith("prefetch:"):
                return None, res.reason, res.detail
        hr = self.host.ref_of(ref.abi, _key(ref), ref.snapshot)
        if hr is None:
            return None, None, ""
        h = self.host.read([hr], expect, count)
        if h.payloads:
            return h.payloads[0], None, ""
        return (None, None, "") if h.reason == MISSING else (None, h.reason, h.detail)

    def _from_disk(self, out: list[BlockPayload], rest: list[BlockRef], expect, count: bool) -> ReadResult:
        """`out` + what the disk tier reads of `rest` (promoted into host memory in the background)."""
        d = self.disk.read(rest, expect, count)
        if d.payloads:
            with contextlib.suppress(RuntimeError):  # (closing: nothing is promoted)
                self._promoter.submit(self._promote, rest[0].abi, d.payloads)
        return ReadResult(out + d.payloads, d.reason, d.detail)

    def _relookup(self, rest: list[BlockRef]) -> list[BlockRef]:
        """Disk refs of `rest` (refs into the host tier, or disk refs of blocks since promoted and
        evicted), up to the first the disk tier lacks or holds with another snapshot flag."""
        first = rest[0]
        i0 = first.entry["index"]
        keys: list[bytes] = [b""] * i0 + [_key(r) for r in rest]
        tokens: list[list[int]] = [[]] * i0 + [list(r.raw_tokens or r.entry["tokens"]) for r in rest]
        if i0 > 0:
            keys[i0 - 1] = first.raw_parent or bytes.fromhex(first.entry["parent"] or "")
        d = self.disk.find_chain(first.abi, keys, tokens, start=i0)
        out = []
        for want, got in zip(rest, d.refs, strict=False):
            if got.snapshot != want.snapshot:
                break
            out.append(got)
        return out

    # ------------------------------------------------------------------------------ write
    def write_async(self, abi: str, blocks: list[BlockPayload]) -> concurrent.futures.Future:
        """Hold `blocks` in the host tier (`HostTier.write_async`: resolved at once; over budget,
        evicted blocks go to the disk tier in the background).

        Args:
            abi: the ABI fingerprint (32 hex digits).
            blocks: at least one block.
        Returns:
            The resolved future (the block keys, or the exception).
        """
        self._check_open("write_async")
        return self.host.write_async(abi, blocks)

    def write(self, abi: str, blocks: list[BlockPayload]) -> list[bytes]:
        """Synchronous `write_async`. Returns the block keys."""
        return self.write_async(abi, blocks).result()

    def _spill(self, abi: str, payloads: list[BlockPayload]) -> concurrent.futures.Future:
        """The host tier's `spill`: write the blocks the disk tier lacks (a future of their keys)."""
        need = []
        for p in payloads:
            try:
                stored, snap = self.disk.contains(abi, p.key)
            except Exception:  # unknown: written again (content addressed, so harmless)
                stored = snap = False
            if not (snap if p.snapshot else stored):
                need.append(p)
        if not need:
            return _done([])
        return self.disk.write_async(abi, need)

    def persist(self) -> int:
        """Write every host block the disk tier lacks to it and wait (e.g. before a shutdown).
        Returns the blocks written."""
        n = 0
        for abi, payloads in self.host.dirty().items():
            for i in range(0, len(payloads), 256):
                batch = payloads[i : i + 256]
                keys = self._spill(abi, batch).result()
                self.host.mark_clean(abi, [p.key for p in batch])
                n += len(keys)
        self.disk.flush()
        return n

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the prefetches, the spills in flight and every disk write issued so far.

        Args:
            timeout: seconds at most per wait (None: no limit).
        """
        self._check_open("flush")
        self.wait_prefetch(None, timeout)
        self.host.flush(timeout)
        self.disk.flush(timeout)

    def close(self, persist: bool = True) -> None:
        """Stop prefetching, write the host blocks the disk tier lacks (unless `persist` is False),
        close both tiers. `closed` is then True; a second call does nothing.

        Args:
            persist: write the host-only blocks to disk first.
        """
        if self._closed:
            return
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._promoter.shutdown(wait=True)
        if persist and not self.disk.closed:
            self.persist()
        self._closed = True
        self.host.close()
        self.disk.close()


__all__ = ["TieredStore"]
