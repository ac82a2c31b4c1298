"""Warm restart: save a whole `Engine` (its `HybridCache` and the host-side settings that rebuild it)
and restore it so a restarted server resumes with its device cache — running state, prefix records,
TAIL snapshots, counters — intact and verified.

On disk, `path` is a directory (format version 3; version 2 had the same files):
    hkv_engine.json   the metadata (plain JSON, no pickle): format name + version, the `CacheConfig`
                      fields, block_tokens, prefill_chunk, model_id (a label), retention policy, cache
                      salt (hex), the ABI fingerprint and the spec it hashes (with the weights digest,
                      `hkv.weights`), the name of the array directory (`cache_dir`), and one entry per
                      cache leaf in `jax.tree_util` flatten order — key path, shape, dtype, crc32 of its
                      bytes — sealed by a crc32 of the whole document. This file is the checkpoint's
                      single commit point: it names the array directory it belongs to.
    cache-<32 hex>/   an orbax-checkpoint (StandardCheckpointHandler) of the cache's leaves as a flat
                      dict {"leaf_00000": array, ...}; zero-size leaves (e.g. the overlap slice of a
                      non-overlapping compressor, [S, 0, D]) are not stored — orbax refuses them — and
                      are rebuilt from the fresh cache on restore.
An `hkv.MeshEngine`'s checkpoint (`save_mesh_engine` / `restore_mesh_engine`) is the same format, with
its stacked cache as the arrays (every leaf [D, ...]: data shard d's cache at index d) and one more
metadata field, `mesh` = {data_shards: D, data_axis, model_axis, route}; its `config` is the whole
mesh's (each shard's capacities times D), `engine` the settings every shard shares. A single-device
engine refuses a mesh checkpoint and a mesh engine a single-device one; it restores onto a mesh whose
data axis has D devices (any model-axis size).
Version 1 (hkv before the weights digest) kept the arrays in `cache/`; its metadata is still read
(`read_metadata`), but `restore_engine` refuses it: its fingerprint names a `model_id` label, not the
weights, so it cannot prove the cache was computed by the restoring model.

Atomicity, whatever instant the process is killed (SIGKILL, power loss after fsync):
  * a new `path`: everything is written into `.<name>.tmp-<32 hex>/` next to it, fsynced (files and
    directories), then renamed to `path` in one `rename`;
  * `overwrite=True` on an existing checkpoint: the new arrays go to a new `cache-<token>/` inside
    `path` (fsynced), the new metadata to `.hkv_engine.json.tmp-<token>` (fsynced), which then
    replaces `hkv_engine.json` in one `os.replace` (then the directory is fsynced). Before that
    instant `path` is the old checkpoint, after it the new one; the old arrays are deleted only
    afterwards. A killed save leaves only unreferenced entries, which the next save of the same `path`
    deletes: names of our patterns (`cache`, `cache-<hex>…`, `.hkv_engine.json.tmp-<hex>` inside
    `path`; `.<name>.tmp-<hex>` / `.<name>.old-<hex>` beside it), not the live array directory, and
    last modified before that save began. Saving one `path` from two processes at once is not supported.

`restore_engine` trusts nothing it reads: the JSON is bounded (`MAX_METADATA_BYTES`, nesting depth
`MAX_JSON_DEPTH`) and every field is type- and range-checked (`EngineCheckpointError` naming the
value, never a RecursionError / OverflowError / MemoryError / UnicodeError); the rebuilt engine's ABI
fingerprint — weights digest included — must equal the saved one (checked, with every leaf's shape,
before the engine allocates its cache); every leaf's shape and dtype must equal the fresh cache's
(orbax would silently cast a dtype), every leaf's crc32 must match (orbax does not notice a flipped
byte in its compressed data files), and `hkv.check_invariants` must hold before the cache is
installed. Any failure raises; a half-restored engine is never returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
import uuid
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..core.invariants import check_invariants
from ..core.layout import CacheConfig, CacheLayout
from ..core.policy import RetentionPolicy
from ..core.prefix_index import RecordState
from ..core.state import check_layout, init_cache

FORMAT_NAME = "hkv-engine-checkpoint"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
METADATA_FILE = "hkv_engine.json"
CACHE_DIR = "cache"  # version 1's array directory; version 2 names its own (`cache_dir`)
MAX_METADATA_BYTES = 16 << 20  # a real engine's metadata is tens of KiB
MAX_JSON_DEPTH = 16  # the schema nests 5 deep (doc.spec.layers[i].compressor)
MAX_LEAVES = 1 << 16

_TOKEN = r"[0-9a-f]{32}"
_CACHE_DIR_RE = re.compile(rf"cache-{_TOKEN}")
_INSIDE_PATTERNS = (re.compile(rf"cache(-{_TOKEN}.*)?"), re.compile(rf"\.{re.escape(METADATA_FILE)}\.tmp-{_TOKEN}"))

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_JSON_DEPTH",
    "MAX_METADATA_BYTES",
    "METADATA_FILE",
    "READABLE_VERSIONS",
    "EngineCheckpointError",
    "cache_dir",
    "read_metadata",
    "restore_engine",
    "restore_mesh_engine",
    "save_engine",
    "save_mesh_engine",
]


class EngineCheckpointError(ValueError):
    """An engine checkpoint cannot be written or used: missing/corrupt/oversized/unknown-version
    metadata, a field of the wrong type or out of range, an ABI fingerprint that differs from the
    restoring engine's (other weights, dtype, dims), leaves whose shape, dtype or checksum differ,
    or an engine that is mid-generation. The message names the offending value."""


# ------------------------------------------------------------------------------------ helpers
def _crc32(a: np.ndarray) -> int:
    """crc32 of an array's C-order bytes (host byte order; every supported host is little-endian)."""
    return zlib.crc32(np.ascontiguousarray(a).tobytes()) & 0xFFFFFFFF


def _seal(doc: dict) -> int:
    """crc32 of the canonical JSON of `doc` without its seal field."""
    body = {k: v for k, v in doc.items() if k != "metadata_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()) & 0xFFFFFFFF


def _leaf_key(i: int) -> str:
    return f"leaf_{i:05d}"


def _checkpointer():
    import orbax.checkpoint as ocp  # imported lazily: orbax is heavy and only needed here

    # A synchronous Checkpointer (StandardCheckpointer is async in orbax >= 0.6 and would need
    # wait_until_finished); the args API exists in every orbax-checkpoint >= 0.5.
    return ocp, ocp.Checkpointer(ocp.StandardCheckpointHandler())


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (orbax does not), deepest first, root last."""
    for d, _, files in os.walk(root, topdown=False):
        for name in files:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(d))


def _is_replaceable(p: Path) -> bool:
    """`overwrite=True` only ever replaces a previous engine checkpoint or a directory holding nothing
    but leftovers of killed saves (our names; e.g. an empty directory a save into was killed)."""
    if not p.is_dir() or p.is_symlink():
        return False
    return (p / METADATA_FILE).is_file() or all(any(q.fullmatch(e.name) for q in _INSIDE_PATTERNS) for e in p.iterdir())


def cache_dir(path: str | os.PathLike) -> Path:
    """The array directory of the checkpoint at `path` (versions 2-3: the one its metadata names;
    version 1: `cache/`). Raises `EngineCheckpointError` as `read_metadata` does."""
    path = Path(os.fspath(path))
    doc = read_metadata(path)
    return path / (doc["cache_dir"] if doc["version"] >= 2 else CACHE_DIR)


# --------------------------------------------------------------------------------------- save
def save_engine(engine, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Save `engine` (an idle `hkv.Engine`) to the directory `path`; see the module docstring.

    Stores `engine.cache` (every leaf, bit-exact) with orbax and the settings that rebuild the engine
    (`engine.layout.config`, `engine.spec.block_tokens`, `engine.prefill_chunk`,
    `engine.spec.model_id`, `engine.retention`, `engine.cache_salt`) plus the ABI fingerprint (which
    covers the weights' digest) and one crc32 per leaf in JSON. The model weights are not saved:
    `restore_engine` takes the model and checks it is the same.

    Args:
      engine: an `hkv.Engine` between `generate` calls.
      path: the checkpoint directory.
      overwrite: replace an existing checkpoint (or empty directory) at `path`, never anything else.
    Raises:
      EngineCheckpointError: sequences are running (`engine.generate` in progress: their host-side
        state is not part of the checkpoint), or `path` exists and `overwrite` is False, or `path`
        is something other than a checkpoint or an empty directory.

    The write is atomic whatever instant the process dies (module docstring): `path` always holds
    either the previous checkpoint or the new one, complete; stale entries of killed saves are
    deleted by the next save of `path`.
    """
    path = Path(os.fspath(path)).absolute()
    started = time.time()
    _check_idle(engine)
    replacing = _check_path(path, overwrite)
    snapshot = _snapshot_cache(engine.cache)
    token = uuid.uuid4().hex
    _write_checkpoint(path, _metadata(engine, snapshot.leaves, token), snapshot.stored, replacing, started)


def _write_checkpoint(
    path: Path, doc: dict[str, Any], stored: dict[str, np.ndarray], replacing: bool, started: float
) -> None:
    """Write the checkpoint `doc` (sealed metadata) + `stored` (its arrays) at `path`, atomically (module docstring).

    Args:
      path: the checkpoint directory (absolute), checked by `_check_path`.
      doc: the metadata; its `cache_dir` names this save's array directory (`cache-<token>`).
      stored: the arrays to store (`_CacheSnapshot.stored`).
      replacing: whether something exists at `path` (`_check_path`'s answer).
      started: when the save began (`time.time()`): older leftovers of killed saves are deleted.
    Raises:
      EngineCheckpointError: a write failed (naming `path`), or `path` appeared while saving.
    """
    ocp, ck = _checkpointer()
    job = _SaveJob(doc=doc, stored=stored, token=doc["cache_dir"].removeprefix("cache-"), ocp=ocp, checkpointer=ck)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not replacing:
            _save_new(path, job)
        else:
            _save_over(path, job)
        _clean_stale(path, keep=doc["cache_dir"], before=started)
    except OSError as err:  # a path under a regular file, a read-only or full filesystem, ...
        raise EngineCheckpointError(
            f"cannot save an engine checkpoint at {str(path)!r}: {err.strerror or err} (is its parent a "
            f"writable directory?)"
        ) from err


def _check_idle(engine, shard: int | None = None) -> None:
    """Refuse to save unless `engine` (or data shard `shard` of a mesh engine) runs and holds no request.

    Raises:
      EngineCheckpointError: sequences are running, or requests are submitted and not finished.
    """
    where = "" if shard is None else f" on data shard {shard}"
    running = sorted(q.slot for q in engine.scheduler.live())
    if running:
        raise EngineCheckpointError(
            f"cannot save while {len(running)} sequence(s) are running{where} (slots {running}); "
            f"save between steps or generate() calls"
        )
    queued = engine.pending
    if queued:
        raise EngineCheckpointError(
            f"cannot save with {queued} request(s) submitted and not finished{where}: a checkpoint holds the cache, "
            f"not requests; run them first (engine.run_until_idle()) or cancel their handles"
        )


def _check_path(path: Path, overwrite: bool) -> bool:
    """Refuse to save unless `path` is free, or replaceable and `overwrite` is set.

    Args:
      path: the checkpoint directory (absolute).
      overwrite: whether an existing checkpoint (or a directory of a killed save's leftovers) may be replaced.
    Returns:
      whether something exists at `path` (the save replaces it) or not (the save creates it).
    Raises:
      EngineCheckpointError: `path` exists and `overwrite` is False, or `path` is something other than a
        checkpoint or an empty directory.
    """
    replacing = path.exists() or path.is_symlink()
    if replacing:
        if not overwrite:
            raise EngineCheckpointError(f"{str(path)!r} already exists; pass overwrite=True to replace it")
        if not _is_replaceable(path):
            raise EngineCheckpointError(
                f"{str(path)!r} exists and is not an hkv engine checkpoint or an empty "
                f"directory; refusing to overwrite it"
            )
    return replacing


class _CacheSnapshot(NamedTuple):
    """A host copy of a cache's leaves, as a checkpoint stores them."""

    leaves: list[dict[str, Any]]  # one metadata entry per leaf, in `jax.tree_util` flatten order
    stored: dict[str, np.ndarray]  # the non-empty leaves, keyed by `_leaf_key(index)`


def _snapshot_cache(cache) -> _CacheSnapshot:
    """Copy `cache`'s leaves to the host (one device->host copy) and describe each one.

    Args:
      cache: the engine's `HybridCache`.
    Returns:
      each leaf's metadata entry (key path, shape, dtype, crc32, whether it is stored) and the arrays to
      store: every leaf but the zero-size ones (orbax refuses them; they carry no data).
    """
    leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(cache)
    host = [np.asarray(jax.device_get(x)) for _, x in leaves_with_path]  # one device->host copy
    leaf_meta, stored = [], {}
    for i, ((kp, _), a) in enumerate(zip(leaves_with_path, host, strict=True)):
        keep = a.size > 0  # orbax refuses zero-size arrays; they carry no data
        leaf_meta.append(
            {
                "path": jax.tree_util.keystr(kp),
                "shape": list(a.shape),
                "dtype": a.dtype.name,
                "crc32": _crc32(a),
                "stored": keep,
            }
        )
        if keep:
            stored[_leaf_key(i)] = a
    return _CacheSnapshot(leaf_meta, stored)


def _metadata(engine, leaves: list[dict[str, Any]], token: str) -> dict[str, Any]:
    """The checkpoint's metadata document (format version `FORMAT_VERSION`), sealed by its crc32.

    Args:
      engine: the engine being saved.
      leaves: the cache leaves' metadata entries (`_snapshot_cache`).
      token: this save's 32-hex token: the arrays go to `cache-<token>/`.
    Returns:
      the document `hkv_engine.json` holds (module docstring), `metadata_crc32` included.
    """
    cfg = engine.layout.config
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "config": {
            "slots": cfg.slots,
            "max_context": cfg.max_context,
            "page_size": cfg.page_size,
            "pool_pages": None if cfg.pool_pages is None else [int(p) for p in cfg.pool_pages],
            "prefix_records": cfg.prefix_records,
            "tail_snapshots": cfg.tail_snapshots,
        },
        "engine": _engine_settings(engine),
        "abi_fingerprint": engine.spec.fingerprint(),
        "spec": engine.spec.to_json(),
        "cache_dir": f"cache-{token}",
        "leaves": leaves,
        "versions": {"jax": jax.__version__, "orbax_checkpoint": _orbax_version()},
    }
    doc["metadata_crc32"] = _seal(doc)
    return doc


def _engine_settings(engine) -> dict[str, Any]:
    """The metadata's `engine` section: the engine settings a restore passes to `hkv.Engine` again.

    Args:
      engine: the engine being saved.
    Returns:
      block_tokens, prefill_chunk, model_id, retention, cache_salt (hex), the batching and bucket settings,
      decode_while_building, and the names of the set settings a checkpoint cannot hold (`not_saved`).
    """
    ret = engine.retention
    return {
        "block_tokens": engine.spec.block_tokens,
        "prefill_chunk": engine.prefill_chunk,
        "model_id": engine.spec.model_id,
        "retention": {f.name: getattr(ret, f.name) for f in dataclasses.fields(ret)},
        "cache_salt": bytes(engine.cache_salt).hex(),
        "prefill_batch": engine.prefill_batch,
        "prefill_buckets": [int(w) for w in engine.prefill_widths[:-1]],
        "read_buckets": [int(r) for r in engine.read_sizes if r is not None],
        "decode_steps": engine.decode_steps,
        "restore_choice": engine.restore_choice,
        "decode_while_building": bool(engine.decode_while_building),
        # settings a checkpoint cannot hold (objects, callables): restore warns when they are not given again
        "not_saved": [name for name, set_ in engine.unsaved_settings().items() if set_],
    }


def save_mesh_engine(mesh_engine, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Save `mesh_engine` (an idle `hkv.MeshEngine`) to the directory `path`: a checkpoint of the same
    format as `save_engine`'s (same files, atomicity and checks) whose arrays are the mesh's stacked
    cache (every leaf [D, ...], gathered to the host) and whose metadata adds a `mesh` section.

    The metadata's `config` is the whole mesh's resolved `CacheConfig` (each shard's capacities times
    D), `engine` the settings every shard shares, `spec`/`abi_fingerprint` a shard's (the same for
    every shard), and `mesh` = {data_shards: D, data_axis, model_axis, route}. The model axis's size
    is not saved: the cache is replicated within a data shard, so any model-axis size restores it.

    Args:
      mesh_engine: an `hkv.MeshEngine` between calls (`MeshEngine.save` has flushed its disk writes).
      path: the checkpoint directory.
      overwrite: as `save_engine`'s.
    Raises:
      EngineCheckpointError: as `save_engine` (any shard running or holding requests; `path`), or the
        shards' settings differ (a checkpoint holds one set of them).
    """
    path = Path(os.fspath(path)).absolute()
    started = time.time()
    for e in mesh_engine.shards:
        _check_idle(e, e.shard)
    _check_same_settings(mesh_engine.shards)
    replacing = _check_path(path, overwrite)
    snapshot = _snapshot_cache(mesh_engine.cache)
    token = uuid.uuid4().hex
    _write_checkpoint(path, _mesh_metadata(mesh_engine, snapshot.leaves, token), snapshot.stored, replacing, started)


def _check_same_settings(shards: list) -> None:
    """Refuse to save a mesh engine whose data shards' engine settings (`_engine_settings`) differ.

    Raises:
      EngineCheckpointError: naming the first shard and setting that differ from shard 0's.
    """
    first = _engine_settings(shards[0])
    for e in shards[1:]:
        theirs = _engine_settings(e)
        differ = sorted(k for k in first if first[k] != theirs.get(k))
        if differ:
            k = differ[0]
            raise EngineCheckpointError(
                f"cannot save this MeshEngine: data shard {e.shard} has {k}={_show(theirs.get(k))} but shard 0 "
                f"has {_show(first[k])} (a checkpoint holds one set of engine settings for every shard; "
                f"set {', '.join(differ)} the same on every shard first)"
            )


def _mesh_metadata(mesh_engine, leaves: list[dict[str, Any]], token: str) -> dict[str, Any]:
    """A mesh engine's metadata document (`save_mesh_engine`), sealed by its crc32.

    Args:
      mesh_engine: the `hkv.MeshEngine` being saved.
      leaves: its stacked cache's leaf entries (`_snapshot_cache`).
      token: this save's 32-hex token.
    Returns:
      shard 0's document (`_metadata`) with the whole mesh's `config`, the mesh engine's `not_saved`
      names and the `mesh` section.
    """
    shards = mesh_engine.shards
    doc = _metadata(shards[0], leaves, token)
    n = len(shards)
    cfg = doc["config"]
    for name in ("slots", "prefix_records", "tail_snapshots"):
        cfg[name] = None if cfg[name] is None else cfg[name] * n
    cfg["pool_pages"] = None if cfg["pool_pages"] is None else [p * n for p in cfg["pool_pages"]]
    unsaved = mesh_engine.unsaved_settings()
    doc["engine"]["not_saved"] = [name for name in _NOT_SAVED if unsaved.get(name)]
    doc["mesh"] = {
        "data_shards": n,
        "data_axis": mesh_engine.data_axis,
        "model_axis": mesh_engine.model_axis,
        "route": mesh_engine.routing,
    }
    doc["metadata_crc32"] = _seal(doc)
    return doc


@dataclasses.dataclass(frozen=True)
class _SaveJob:
    """One save's content and its writer: the sealed metadata, the arrays, this save's token, orbax."""

    doc: dict[str, Any]
    stored: dict[str, np.ndarray]  # `_CacheSnapshot.stored`
    token: str  # names this save's array directory and temporary entries
    ocp: Any  # the orbax.checkpoint module
    checkpointer: Any  # a synchronous orbax Checkpointer (`_checkpointer`)

    def write_arrays(self, into: Path) -> None:
        """Write the arrays as an orbax checkpoint at `into`, then fsync every file and directory under it."""
        self.checkpointer.save(into, args=self.ocp.args.StandardSave(self.stored))
        _fsync_tree(into)

    def write_metadata(self, f: Path) -> None:
        """Write the metadata JSON to the file `f` and fsync it."""
        with open(f, "w") as fh:
            json.dump(self.doc, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())


def _save_new(path: Path, job: _SaveJob) -> None:
    """Create the checkpoint at `path` (nothing there): build it whole in `.<name>.tmp-<token>/` beside
    `path`, fsynced, then one `os.rename` to `path`; the temporary directory never outlives the call.

    Args:
      path: the checkpoint directory (absolute, absent; its parent exists).
      job: what to write.
    Raises:
      EngineCheckpointError: `path` appeared while saving (nothing was replaced).
      OSError: a write failed.
    """
    tmp = path.parent / f".{path.name}.tmp-{job.token}"
    try:
        tmp.mkdir()
        job.write_arrays(tmp / job.doc["cache_dir"])
        job.write_metadata(tmp / METADATA_FILE)
        _fsync_dir(tmp)
        try:
            os.rename(tmp, path)
        except OSError as err:  # another process created `path` meanwhile
            raise EngineCheckpointError(f"{str(path)!r} appeared while saving ({err}); nothing was replaced") from err
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _save_over(path: Path, job: _SaveJob) -> None:
    """Replace the checkpoint at `path`: the new arrays go to `cache-<token>/` beside the old ones, the
    new metadata to `.hkv_engine.json.tmp-<token>` (both fsynced), which one `os.replace` makes
    `hkv_engine.json` (the one atomic switch). If the switch did not happen, this save's entries are
    deleted and the live checkpoint is untouched; the old arrays are left to `_clean_stale`.

    Args:
      path: an existing, replaceable checkpoint directory (absolute).
      job: what to write.
    Raises:
      OSError (or whatever interrupted the save): a write failed; `path` is the old checkpoint.
    """
    new_tmp = path / f".{METADATA_FILE}.tmp-{job.token}"
    try:
        job.write_arrays(path / job.doc["cache_dir"])
        job.write_metadata(new_tmp)
        _fsync_dir(path)
        os.replace(new_tmp, path / METADATA_FILE)
        _fsync_dir(path)
    except BaseException:
        # not switched: this save's entries are garbage (the live checkpoint is untouched)
        if not (path / METADATA_FILE).is_file() or _live_cache_dir(path) != job.doc["cache_dir"]:
            shutil.rmtree(path / job.doc["cache_dir"], ignore_errors=True)
            if new_tmp.exists():
                new_tmp.unlink()
        raise


def _live_cache_dir(path: Path) -> str | None:
    """The `cache_dir` named by the metadata at `path` now (None if it cannot be read)."""
    try:
        doc = read_metadata(path)
    except EngineCheckpointError:
        return None
    return doc["cache_dir"] if doc["version"] >= 2 else CACHE_DIR


def _clean_stale(path: Path, *, keep: str, before: float) -> None:
    """Delete what killed or finished saves of `path` left behind: entries named by our patterns,
    other than the live array directory `keep`, last modified before `before` (this save's start)."""
    stale = []
    if path.is_dir():
        for e in path.iterdir():
            if e.name != keep and any(p.fullmatch(e.name) for p in _INSIDE_PATTERNS):
                stale.append(e)
    beside = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-([0-9a-f]{{12}}|{_TOKEN})")
    for e in path.parent.iterdir():
        if beside.fullmatch(e.name):
            stale.append(e)
    for e in sorted(stale):
        try:
            if e.lstat().st_mtime > before:
                continue  # not provably stale: another save may be writing it
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e)
            else:
                e.unlink()
        except OSError:
            continue  # gone already, or not ours to delete: the next save tries again
    if stale:
        _fsync_dir(path)
        _fsync_dir(path.parent)


def _orbax_version() -> str:
    try:
        import orbax.checkpoint as ocp

        return str(getattr(ocp, "__version__", "unknown"))
    except Exception:  # pragma: no cover
        return "unknown"


# ------------------------------------------------------------------------------------ restore
_I32 = 2**31 - 1
_SHORT = 1024  # longest label / key path / version string accepted
_STR_SHOWN = 120  # characters of a bad value quoted in an error message


def _show(v: Any) -> str:
    """A bounded repr of a (possibly hostile) value for an error message."""
    try:
        r = repr(v)
    except (RecursionError, ValueError, MemoryError):  # pragma: no cover (depth is bounded before)
        r = f"<{type(v).__name__}>"
    return r if len(r) <= _STR_SHOWN else r[:_STR_SHOWN] + f"... ({len(r)} chars)"


def _bad(where: str, v: Any, want: str) -> EngineCheckpointError:
    return EngineCheckpointError(f"checkpoint metadata: {where}={_show(v)} is invalid: want {want}")


_NOT_SAVED = ("disk", "tokenizer", "kernel_options", "progress", "seed", "tensor_parallel", "expert_axes")


def _obj(d: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """`d` must be a JSON object with exactly the `required` keys (plus any of `optional`)."""
    if not isinstance(d, dict):
        raise _bad(where or "metadata", d, "a JSON object")
    missing = [k for k in required if k not in d]
    if missing:
        raise EngineCheckpointError(f"checkpoint metadata: missing field {where + '.' if where else ''}{missing[0]!r}")
    extra = sorted(k for k in d if k not in required and k not in optional)
    if extra:
        prefix = where + "." if where else ""
        raise EngineCheckpointError(
            f"checkpoint metadata: unknown field {prefix}{_show(extra[0])} "
            f"(this hkv knows {sorted(required + optional)})"
        )
    return d


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:  # JSON true is not an int
        raise _bad(where, v, f"an integer in [{lo}, {hi}]")
    return v


def _str(v: Any, where: str, max_len: int = _SHORT, pattern: re.Pattern | None = None, want: str = "") -> str:
    if not isinstance(v, str) or len(v) > max_len or (pattern is not None and not pattern.fullmatch(v)):
        raise _bad(where, v, want or f"a string of at most {max_len} characters")
    return v


def _depth(doc: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar: 0), walked with an explicit stack; stops counting
    at `limit` + 1 (so a hostile document costs at most its size)."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            d += 1
            deepest = max(deepest, d)
            if d > limit:
                return d
            stack.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
# A bfloat16 pool is held as uint16 bit patterns on CPU (`hkv.CacheLayout.pool_bits`) and as bfloat16
# elsewhere: a checkpoint of either restores into the other (the same bytes, viewed).
_POOL_BITS = frozenset({"uint16", "bfloat16"})
_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int4",
        "uint4",
    }
)


def read_metadata(path: str | os.PathLike) -> dict:
    """The schema-checked metadata dict of the engine checkpoint at `path` (see the module docstring).

    Args:
      path: the checkpoint directory.
    Returns:
      the metadata as a dict (version 1, 2 or 3; versions 2-3 have "cache_dir").
    Raises:
      EngineCheckpointError (and nothing else) when the file is missing or unreadable, larger than
      `MAX_METADATA_BYTES`, not UTF-8 JSON, nested deeper than `MAX_JSON_DEPTH`, of another format or
      a version not in `READABLE_VERSIONS`, fails its crc32 seal, or any field is missing, unknown,
      of the wrong type or out of range (the message names the field and the bad value).
    """
    f = Path(os.fspath(path)) / METADATA_FILE
    try:
        if not f.is_file():
            raise EngineCheckpointError(f"{str(path)!r} is not an hkv engine checkpoint: {METADATA_FILE} missing")
        size = f.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise EngineCheckpointError(
                f"{str(f)!r}: metadata is {size} bytes, more than MAX_METADATA_BYTES={MAX_METADATA_BYTES}"
            )
        with open(f, "rb") as fh:
            raw = fh.read(MAX_METADATA_BYTES + 1)
        if len(raw) > MAX_METADATA_BYTES:
            raise EngineCheckpointError(f"{str(f)!r}: metadata grew past MAX_METADATA_BYTES={MAX_METADATA_BYTES}")
        # json's C parser bounds its own recursion (RecursionError, caught below); whatever it returns is
        # then bounded to MAX_JSON_DEPTH before anything recursive (the seal, repr, ==) touches it.
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        depth = _depth(doc, MAX_JSON_DEPTH)
        if depth > MAX_JSON_DEPTH:
            raise EngineCheckpointError(
                f"{str(f)!r}: metadata nests more than MAX_JSON_DEPTH={MAX_JSON_DEPTH} levels deep"
            )
        if not isinstance(doc, dict):
            raise EngineCheckpointError(f"{str(f)!r}: metadata is a {type(doc).__name__}, not a JSON object")
        if doc.get("format") != FORMAT_NAME:
            raise EngineCheckpointError(f"{str(f)!r}: format={_show(doc.get('format'))}, expected {FORMAT_NAME!r}")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise EngineCheckpointError(
                f"{str(f)!r}: unknown version={_show(version)} (this hkv reads versions {list(READABLE_VERSIONS)})"
            )
        seal = doc.get("metadata_crc32")
        if seal != _seal(doc):
            raise EngineCheckpointError(
                f"{str(f)!r}: metadata_crc32={_show(seal)} does not match its contents "
                f"({_seal(doc)}): the file was edited or corrupted"
            )
        _check_schema(doc, version)
    except EngineCheckpointError:
        raise
    except (OSError, UnicodeError, ValueError, RecursionError, OverflowError, MemoryError, TypeError) as e:
        # JSONDecodeError, int-digit limits, non-UTF-8 bytes, lone surrogates, deep structures ...
        raise EngineCheckpointError(f"{str(f)!r}: corrupt metadata ({type(e).__name__}: {str(e)[:300]})") from e
    return doc


def _check_schema(doc: dict, version: int) -> None:
    """Every field of a version-`version` metadata document: type, range, exact key sets."""
    top = ("format", "version", "config", "engine", "abi_fingerprint", "spec", "leaves", "versions", "metadata_crc32")
    _obj(doc, "", top + (("cache_dir",) if version >= 2 else ()), ("mesh",) if version >= 2 else ())
    if "mesh" in doc:
        _check_mesh_section(doc["mesh"])
    _int(doc["metadata_crc32"], "metadata_crc32", 0, 2**32 - 1)
    if version >= 2:
        _str(doc["cache_dir"], "cache_dir", 64, _CACHE_DIR_RE, "'cache-' and 32 lowercase hex digits")
    cfg = _obj(
        doc["config"], "config", ("slots", "max_context", "page_size", "pool_pages", "prefix_records", "tail_snapshots")
    )
    _int(cfg["slots"], "config.slots", 1, 1 << 16)
    _int(cfg["max_context"], "config.max_context", 1, _I32)
    _int(cfg["page_size"], "config.page_size", 1, 1 << 20)
    _int(cfg["prefix_records"], "config.prefix_records", 0, 1 << 24)
    if cfg["tail_snapshots"] is not None:
        _int(cfg["tail_snapshots"], "config.tail_snapshots", 0, 1 << 24)
    pp = cfg["pool_pages"]
    if pp is not None:
        if not isinstance(pp, list) or not 1 <= len(pp) <= 256:
            raise _bad("config.pool_pages", pp, "null or a list of 1 to 256 integers")
        for i, p in enumerate(pp):
            _int(p, f"config.pool_pages[{i}]", 1, _I32)
    optional = ("prefill_batch", "prefill_buckets", "read_buckets", "decode_steps", "restore_choice",
                "decode_while_building", "not_saved")  # fmt: skip
    eng = _obj(
        doc["engine"], "engine", ("block_tokens", "prefill_chunk", "model_id", "retention", "cache_salt"), optional
    )
    for name in ("prefill_batch", "decode_steps"):
        if name in eng:
            _int(eng[name], f"engine.{name}", 1, 1 << 20)
    for name in ("prefill_buckets", "read_buckets"):
        if name in eng:
            if not isinstance(eng[name], list) or len(eng[name]) > 64:
                raise _bad(f"engine.{name}", eng[name], "a list of at most 64 integers")
            for i, w in enumerate(eng[name]):
                _int(w, f"engine.{name}[{i}]", 1, _I32)
    if "restore_choice" in eng and eng["restore_choice"] not in ("cheapest", "longest"):
        raise _bad("engine.restore_choice", eng["restore_choice"], "'cheapest' or 'longest'")
    if "decode_while_building" in eng and not isinstance(eng["decode_while_building"], bool):
        raise _bad("engine.decode_while_building", eng["decode_while_building"], "true or false")
    if "not_saved" in eng and not (
        isinstance(eng["not_saved"], list) and all(n in _NOT_SAVED for n in eng["not_saved"])
    ):
        raise _bad("engine.not_saved", eng["not_saved"], f"a list of names among {list(_NOT_SAVED)}")
    _int(eng["block_tokens"], "engine.block_tokens", 1, 1 << 20)
    _int(eng["prefill_chunk"], "engine.prefill_chunk", 1, 1 << 24)
    _str(eng["model_id"], "engine.model_id")
    ret = _obj(eng["retention"], "engine.retention", tuple(f.name for f in dataclasses.fields(RetentionPolicy)))
    _int(ret["every_n_blocks"], "engine.retention.every_n_blocks", 1, _I32)
    if not isinstance(ret["branch_points_only"], bool):
        raise _bad("engine.retention.branch_points_only", ret["branch_points_only"], "true or false")
    _str(eng["cache_salt"], "engine.cache_salt", 8192, _HEX, "an even number of lowercase hex digits (<= 4096 bytes)")
    _str(doc["abi_fingerprint"], "abi_fingerprint", 32, _HEX32, "32 lowercase hex digits")
    spec = doc["spec"]
    if not isinstance(spec, dict):
        raise _bad("spec", spec, "a JSON object (the CacheSpec the fingerprint hashes)")
    if version >= 2:
        wd = spec.get("weights_digest")
        if not (isinstance(wd, str) and _HEX32.fullmatch(wd)):
            raise _bad("spec.weights_digest", wd, "32 lowercase hex digits (hkv.weights.weights_digest)")
    leaves = doc["leaves"]
    if not isinstance(leaves, list) or len(leaves) > MAX_LEAVES:
        raise _bad("leaves", leaves, f"a list of at most {MAX_LEAVES} leaf entries")
    for i, m in enumerate(leaves):
        w = f"leaves[{i}]"
        _obj(m, w, ("path", "shape", "dtype", "crc32", "stored"))
        _str(m["path"], f"{w}.path")
        shape = m["shape"]
        if not isinstance(shape, list) or len(shape) > 16:
            raise _bad(f"{w}.shape", shape, "a list of at most 16 dimensions")
        n = 1
        for j, d in enumerate(shape):
            n *= _int(d, f"{w}.shape[{j}]", 0, 1 << 40)
        if n > 1 << 48:
            raise _bad(f"{w}.shape", shape, f"at most {1 << 48} elements")
        _str(m["dtype"], f"{w}.dtype", 32)
        if m["dtype"] not in _DTYPES:
            raise _bad(f"{w}.dtype", m["dtype"], f"one of {sorted(_DTYPES)}")
        _int(m["crc32"], f"{w}.crc32", 0, 2**32 - 1)
        if not isinstance(m["stored"], bool):
            raise _bad(f"{w}.stored", m["stored"], "true or false")
    versions = doc["versions"]
    if not isinstance(versions, dict) or len(versions) > 64:
        raise _bad("versions", versions, "a JSON object of at most 64 name: version strings")
    for k, v in versions.items():
        _str(v, f"versions.{_show(k)}", 256)


_AXIS = re.compile(r"[^\x00-\x1f]{1,256}")


def _check_mesh_section(m: Any) -> None:
    """A mesh engine's checkpoint's `mesh` section (`save_mesh_engine`): type, range, exact key set."""
    _obj(m, "mesh", ("data_shards", "data_axis", "model_axis", "route"))
    _int(m["data_shards"], "mesh.data_shards", 1, 1 << 16)
    _str(m["data_axis"], "mesh.data_axis", 256, _AXIS, "a mesh axis name (1 to 256 printable characters)")
    if m["model_axis"] is not None:
        _str(m["model_axis"], "mesh.model_axis", 256, _AXIS, "null or a mesh axis name")
    if m["route"] not in ("prefix", "balance"):
        raise _bad("mesh.route", m["route"], "'prefix' or 'balance'")


def _abi_diff(saved: dict, now: dict) -> str:
    """Which spec fields differ (for the ABI mismatch message; the label `model_id` is not compared)."""
    keys = sorted(k for k in set(saved) | set(now) if isinstance(k, str) and k not in ("layers", "model_id"))
    diff = [f"{k}: {_show(saved.get(k))} -> {_show(now.get(k))}" for k in keys if saved.get(k) != now.get(k)]
    if saved.get("layers") != now.get("layers"):
        diff.append("layers (dims / windows / compressor ratios)")
    return "; ".join(diff) or "no spec field (fingerprint algorithm changed?)"


def restore_engine(engine_cls, path: str | os.PathLike, model, **engine_kwargs):
    """Rebuild the `hkv.Engine` saved at `path` around `model` and install its verified cache.

    Args:
      engine_cls: the engine class to build (`hkv.Engine`; `Engine.restore` passes itself).
      path: a checkpoint directory written by `save_engine` (format version 3).
      model: the same weights the engine was saved with (they are not in the checkpoint; their digest
        — every element, dtype, shape — and the model's dims enter the ABI fingerprint, which must
        match the saved one; the `model_id` label does not).
      engine_kwargs: passed to `hkv.Engine`; they override the saved block_tokens, prefill_chunk,
        model_id, retention, cache_salt and add runtime options (progress, kernel_options, disk).
    Returns:
      the engine, with `engine.cache` = the restored cache.
    Raises:
      EngineCheckpointError: bad metadata (`read_metadata`), a version-1 checkpoint (its fingerprint
        does not cover the weights), settings that do not build an engine, an ABI fingerprint
        mismatch (naming both fingerprints and the differing spec fields, e.g. weights_digest),
        leaves whose key path, shape, dtype or crc32 differ, unreadable arrays.
      hkv.InvariantError: the arrays are intact but break an invariant.

    Steps, each raising before anything is installed: schema-check the metadata; build the saved
    `CacheConfig`; compute the spec this engine will have and compare ABI fingerprints and every
    leaf's key path, shape and dtype (from `jax.eval_shape`, no allocation) — so a foreign or hostile
    checkpoint is refused before the engine allocates a cache; build the engine and re-check its
    fingerprint; read the leaves with orbax onto the host; verify each leaf's crc32; run
    `hkv.core.state.check_layout` and `hkv.check_invariants` on that host copy; only then free the fresh
    cache and upload the verified leaves to the default device, uncommitted, as `init_cache` places
    them (device memory never holds two caches).
    """
    path = _checkpoint_dir(path, model)
    checks = _RestoreChecks(path, _usable_metadata(path, engine_kwargs), engine_kwargs)
    saved = checks.doc.get("mesh")
    if saved is not None:
        raise EngineCheckpointError(
            f"{str(path)!r} is a MeshEngine's checkpoint ({saved['data_shards']} data shards, one stacked cache): "
            f"restore it onto a mesh with {saved['data_shards']} data shards, "
            f"hkv.Engine.restore(path, model, mesh=jax.sharding.Mesh(...))"
        )
    engine = _build_engine(checks, engine_cls, model, _saved_settings(checks), None)
    _restore_cache(checks, engine)
    return engine


def restore_mesh_engine(mesh_cls, path: str | os.PathLike, model, *, mesh, split, **engine_kwargs):
    """Rebuild the `hkv.MeshEngine` saved at `path` (`save_mesh_engine`) on `mesh` around `model` and
    install its verified stacked cache, as `restore_engine` does for one engine.

    Args:
      mesh_cls: the mesh engine class (`MeshEngine.restore` passes itself).
      path: a mesh engine's checkpoint directory.
      model: the same weights the engine was saved with (as `restore_engine`).
      mesh: a `jax.sharding.Mesh` whose data axis has the saved number of data shards (the model axis
        may have any size: a shard's cache is replicated within it).
      split: whole-mesh config, D -> one shard's config (`hkv.engine.sharded.shard_config`).
      engine_kwargs: as `restore_engine`'s, plus the mesh engine's own (data_axis, model_axis, route,
        tensor_parallel, expert_axes); the saved data_axis, model_axis and route apply unless given.
    Returns:
      the mesh engine, with `cache` = the restored stacked cache, placed over `mesh`'s data axis.
    Raises:
      EngineCheckpointError: as `restore_engine`; a single-device engine's checkpoint; a mesh whose data
        axis has another size than the saved data-shard count (naming both) or lacks the data axis.
      hkv.InvariantError: a shard's arrays are intact but break an invariant.
    """
    from jax.sharding import Mesh

    path = _checkpoint_dir(path, model)
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
    checks = _RestoreChecks(path, _usable_metadata(path, engine_kwargs), engine_kwargs)
    saved = checks.doc.get("mesh")
    if saved is None:
        raise EngineCheckpointError(
            f"{str(path)!r} is a single-device engine's checkpoint, not a MeshEngine's: restore it with "
            f"hkv.Engine.restore(path, model) (no mesh=)"
        )
    axis, n = engine_kwargs.get("data_axis", saved["data_axis"]), saved["data_shards"]
    if axis not in mesh.axis_names:
        raise EngineCheckpointError(
            f"{str(path)!r} was saved with data axis {_show(axis)}, which this mesh {tuple(mesh.axis_names)} lacks; "
            f"pass data_axis= to name its data axis"
        )
    if mesh.shape[axis] != n:
        raise EngineCheckpointError(
            f"{str(path)!r} was saved from a MeshEngine with {n} data shards, but this mesh's data axis {axis!r} "
            f"has {mesh.shape[axis]}: a checkpoint restores onto the same number of data shards (each holds "
            f"its own slots, pools and prefix records); the model axis may differ"
        )
    settings = _saved_settings(checks)
    kwargs = {"data_axis": saved["data_axis"], "model_axis": saved["model_axis"], "route": saved["route"]}
    settings = settings._replace(kwargs={**kwargs, **settings.kwargs})
    engine = _build_engine(checks, mesh_cls, model, settings, _MeshTarget(mesh, n, split))
    _restore_cache(checks, engine)
    return engine


def _checkpoint_dir(path: str | os.PathLike, model) -> Path:
    """The absolute checkpoint directory `path`, once `model` is a flax.nnx model and `path` a directory.

    Raises:
      TypeError: `model` is not a flax.nnx model.
      EngineCheckpointError: `path` is not a directory (`_no_checkpoint_error`).
    """
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model={type(model).__name__}: Engine.restore needs the flax.nnx model the engine was saved with "
            "(its weights are not in the checkpoint)"
        )
    path = Path(os.fspath(path)).absolute()
    if not path.is_dir():
        raise _no_checkpoint_error(path)
    return path


def _restore_cache(checks: _RestoreChecks, engine) -> None:
    """Replace `engine`'s fresh cache by the checkpoint's, verified: read the leaves onto the host, check
    each one's crc32, then `check_layout` and `check_invariants` (on a mesh engine, per data shard's
    slice) on that host copy; only then install it. Each shard's prefix manager learns whether its
    cache holds prefix records (`recorded`, as after a call that recorded) and builds its restore
    step ahead.

    Args:
      checks: the restore's checkpoint (its metadata already matched to the engine by `_build_engine`).
      engine: the engine just built, holding a fresh cache (`hkv.Engine`, or an `hkv.MeshEngine`).
    Raises:
      EngineCheckpointError, hkv.InvariantError: as `restore_engine`; nothing is installed then.
    """
    fresh_with_path, treedef = jax.tree_util.tree_flatten_with_path(engine.cache)
    checks.refuse_leaves(fresh_with_path)
    host = _read_verified_leaves(checks, fresh_with_path)
    # Every check runs on the host copy, before any device memory is touched.
    host_cache = jax.tree_util.tree_unflatten(treedef, host)
    shards = _engines(engine)
    stacked = hasattr(engine, "shards")
    for e in shards:
        one = jax.tree.map(lambda a, d=e.shard: a[d], host_cache) if stacked else host_cache
        _check_host_cache(checks.path, e.layout, one, e.shard if stacked else None)
    _install_cache(engine, treedef, fresh_with_path, host)
    # a warm restart whose cache holds prefix records is about to be asked for them: build the prefix
    # lookup's restore step now, in the background (speculative, as after a call that recorded), so
    # its first hit does not compile it on the request's path
    alive = np.asarray(host_cache.prefix.state) == RecordState.ALIVE
    for e in shards:
        e.prefix_manager.recorded = bool(np.any(alive[e.shard] if stacked else alive))
        e._restore_ahead()


def _no_checkpoint_error(path: Path) -> EngineCheckpointError:
    """The error for a `path` that is not a directory, naming the checkpoint an interrupted version-1
    save of an older hkv moved aside (`.<name>.old-<12 hex>/` beside `path`), if there is one.

    Args:
      path: the (absolute) path given to `restore_engine`.
    Returns:
      the `EngineCheckpointError` to raise.
    """
    hint = ""
    if path.parent.is_dir():  # hkv's version-1 save, killed between its two renames, left only this
        old = sorted(
            e.name
            for e in path.parent.iterdir()
            if re.fullmatch(rf"\.{re.escape(path.name)}\.old-[0-9a-f]{{12}}", e.name) and (e / METADATA_FILE).is_file()
        )
        if old:
            hint = (
                f"; {str(path.parent / old[-1])!r} is the checkpoint an interrupted save of an older hkv "
                f"moved aside: rename it to {str(path)!r} to use it"
            )
    return EngineCheckpointError(f"no engine checkpoint at {str(path)!r} (not a directory){hint}")


def _usable_metadata(path: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The schema-checked metadata of the checkpoint at `path`, if this hkv can restore it with `overrides`.

    Args:
      path: the checkpoint directory.
      overrides: the caller's engine keyword arguments.
    Returns:
      the metadata (`read_metadata`), of version 3 or later.
    Raises:
      EngineCheckpointError: as `read_metadata`; a version-1 checkpoint (its fingerprint does not cover
        the weights); a version-2 one (its prefix records' page layout is not this hkv's); `config`
        among the overrides (the arrays have the saved config's shapes).
    """
    doc = read_metadata(path)
    if doc["version"] < 2:
        raise EngineCheckpointError(
            f"{str(path)!r} is a version-{doc['version']} checkpoint: its ABI fingerprint covers the label "
            f"model_id={_show(doc['engine']['model_id'])}, not the weights, so this hkv cannot check that "
            f"it was computed by this model's weights; refusing it (re-create it: run the engine and "
            f"save again; this hkv writes version {FORMAT_VERSION})"
        )
    if doc["version"] < 3:
        raise EngineCheckpointError(
            f"{str(path)!r} is a version-{doc['version']} checkpoint: its prefix records hold a page row of "
            f"the whole context per pool, where this hkv's records keep only their own block's pages "
            f"(hkv.core.prefix), so its cache cannot be installed; refusing it (re-create it: run the "
            f"engine and save again; this hkv writes version {FORMAT_VERSION})"
        )
    if "config" in overrides:
        raise EngineCheckpointError(
            f"config cannot be overridden when restoring {str(path)!r}: the saved cache's arrays have the shapes "
            f"of the saved CacheConfig (see hkv.engine.checkpoint.read_metadata(path)['config']); to serve "
            f"another config build a new hkv.Engine (its prefix cache starts empty)"
        )
    return doc


@dataclasses.dataclass(frozen=True)
class _RestoreChecks:
    """The checks a restore makes against its checkpoint: where it is, its metadata, the caller's overrides."""

    path: Path
    doc: dict[str, Any]  # the metadata (`_usable_metadata`)
    overrides: dict[str, Any]  # the caller's engine keyword arguments

    @contextlib.contextmanager
    def settings_error(self, what: str):
        """A TypeError/ValueError/OverflowError/MemoryError from the saved settings -> EngineCheckpointError."""
        try:
            yield
        except EngineCheckpointError:
            raise
        except (TypeError, ValueError, OverflowError, MemoryError) as err:
            raise EngineCheckpointError(
                f"{str(self.path)!r}: {what} (with overrides {sorted(self.overrides)}): "
                f"{type(err).__name__}: {str(err)[:300]}"
            ) from err

    def refuse_fingerprint(self, spec) -> None:
        """Raise `EngineCheckpointError` unless `spec`'s ABI fingerprint is the saved one (the message names
        both fingerprints and the differing spec fields)."""
        saved_fp, new_fp = self.doc["abi_fingerprint"], spec.fingerprint()
        if saved_fp != new_fp:
            saved_spec, now = self.doc["spec"], spec.to_json()
            if "block_tokens" in self.overrides and saved_spec.get("block_tokens") != now.get("block_tokens"):
                # the caller's own override changed the cache's shape, not the model
                advice = "restore without overriding block_tokens (the cache was saved with the saved value)"
            else:
                advice = "restore with the same weights (bit for bit), dtype and dims"
            raise EngineCheckpointError(
                f"ABI fingerprint mismatch: checkpoint {str(self.path)!r} was saved with {saved_fp}, this "
                f"model/engine gives {new_fp} (differs in {_abi_diff(saved_spec, now)}); {advice}"
            )

    def refuse_leaves(self, fresh_with_path) -> None:
        """Raise `EngineCheckpointError` unless the saved leaves have the key paths, shapes and dtypes of
        `fresh_with_path` (a fresh cache's, or its `jax.eval_shape`'s, leaves with their key paths) and
        exactly the non-empty ones are stored."""
        metas = self.doc["leaves"]
        if len(metas) != len(fresh_with_path):
            raise EngineCheckpointError(
                f"checkpoint has {len(metas)} cache leaves; this engine's cache has {len(fresh_with_path)}"
            )
        for i, ((kp, fresh), m) in enumerate(zip(fresh_with_path, metas, strict=True)):
            name, dtype = jax.tree_util.keystr(kp), jnp.dtype(fresh.dtype).name
            same_bits = {m["dtype"], dtype} == _POOL_BITS  # a bfloat16 pool held as uint16 or not
            if m["path"] != name or tuple(m["shape"]) != tuple(fresh.shape) or (m["dtype"] != dtype and not same_bits):
                raise EngineCheckpointError(
                    f"leaf {i}: checkpoint has cache{_show(m['path'])[1:-1]} {m['dtype']}{m['shape']}, this engine "
                    f"needs cache{name} {dtype}{list(fresh.shape)}"
                )
            size = int(np.prod(fresh.shape, dtype=np.int64))
            if m["stored"] != (size > 0):
                raise EngineCheckpointError(f"leaf {i} cache{name}: stored={m['stored']!r} but its size is {size}")


class _SavedSettings(NamedTuple):
    """What rebuilds the saved engine: its cache config and the keyword arguments of `hkv.Engine`."""

    config: CacheConfig
    kwargs: dict[str, Any]  # the saved settings, updated with the caller's overrides


def _saved_settings(checks: _RestoreChecks) -> _SavedSettings:
    """The saved `CacheConfig` and engine settings, with the caller's overrides applied; warns (naming
    them) when the saved engine had settings a checkpoint cannot hold and the caller does not pass them.

    Args:
      checks: the restore's checkpoint and overrides.
    Returns:
      the config and the keyword arguments to build the engine with.
    Raises:
      EngineCheckpointError: the saved config or retention policy is invalid.
    """
    c, e = checks.doc["config"], checks.doc["engine"]
    try:
        config = CacheConfig(
            slots=c["slots"],
            max_context=c["max_context"],
            page_size=c["page_size"],
            pool_pages=None if c["pool_pages"] is None else tuple(c["pool_pages"]),
            prefix_records=c["prefix_records"],
            tail_snapshots=c["tail_snapshots"],
        )
        retention = RetentionPolicy(**e["retention"])
    except (TypeError, ValueError) as err:
        raise EngineCheckpointError(f"{str(checks.path)!r}: invalid saved config/retention: {err}") from err
    kwargs = dict(
        block_tokens=e["block_tokens"],
        prefill_chunk=e["prefill_chunk"],
        model_id=e["model_id"],
        retention=retention,
        cache_salt=bytes.fromhex(e["cache_salt"]),
    )
    for name in ("prefill_batch", "prefill_buckets", "read_buckets", "decode_steps", "restore_choice"):
        if name in e:  # (checkpoints of earlier versions did not save them: the defaults apply)
            kwargs[name] = tuple(e[name]) if isinstance(e[name], list) else e[name]
    missing = [n for n in e.get("not_saved", ()) if n not in checks.overrides]
    if missing:
        warnings.warn(
            f"Engine.restore({str(checks.path)!r}): the saved engine had {', '.join(missing)} set, which a "
            f"checkpoint cannot hold; pass {', '.join(f'{n}=...' for n in missing)} again to restore them",
            stacklevel=4,  # Engine.restore's caller (via restore_engine)
        )
    kwargs.update(checks.overrides)
    return _SavedSettings(config, kwargs)


class _MeshTarget(NamedTuple):
    """Where a mesh engine's checkpoint is restored (`restore_mesh_engine`)."""

    mesh: Any  # the jax.sharding.Mesh
    shards: int  # its data axis's size (= the saved `mesh.data_shards`)
    split: Callable[[CacheConfig, int], CacheConfig]  # whole config -> one shard's (`sharded.shard_config`)


def _engines(engine) -> list:
    """The engines holding host state: a mesh engine's shards, else the engine itself."""
    return list(getattr(engine, "shards", [engine]))


def _build_engine(checks: _RestoreChecks, engine_cls, model, settings: _SavedSettings, target: _MeshTarget | None):
    """Build the engine the checkpoint describes, refusing a foreign checkpoint before allocating its cache.

    First, without allocating: the spec the engine will have (with `model`'s weights digest) must give
    the saved ABI fingerprint, and its cache's leaves (`jax.eval_shape`; on a mesh, each with the
    leading data axis) the saved key paths, shapes and dtypes. Then the engine is built (allocating a
    fresh cache) and its own spec re-checked.

    Args:
      checks: the restore's checkpoint and overrides.
      engine_cls: the engine class (`hkv.Engine`, or `hkv.MeshEngine` with `target`).
      model: the flax.nnx model.
      settings: the saved config and engine settings (`_saved_settings`).
      target: the mesh a mesh engine's checkpoint is restored onto; None for a single-device engine.
    Returns:
      the engine, holding a fresh cache.
    Raises:
      EngineCheckpointError: the settings do not build a cache or an engine for this model, the
        fingerprint or a leaf differs.
    """
    from flax import nnx

    from ..core.weights import weights_digest

    kwargs = settings.kwargs
    # Before anything is allocated: the spec the engine will have, its fingerprint, its cache's shapes.
    with checks.settings_error("the saved settings do not describe a cache for this model"):
        bt, mid = kwargs["block_tokens"], kwargs["model_id"]
        spec = dataclasses.replace(
            model.cache_spec(block_tokens=bt, model_id=mid), weights_digest=weights_digest(nnx.split(model)[1])
        )
        checks.refuse_fingerprint(spec)
        local = settings.config if target is None else target.split(settings.config, target.shards)
        layout = CacheLayout(spec, local)
        shapes = jax.eval_shape(lambda: init_cache(layout))
        if target is not None:  # the mesh engine's stacked cache: [D, ...] per leaf
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((target.shards, *x.shape), x.dtype), shapes)
    checks.refuse_leaves(jax.tree_util.tree_flatten_with_path(shapes)[0])

    with checks.settings_error("cannot build an engine from the saved settings"):
        where = {} if target is None else {"mesh": target.mesh}
        engine = engine_cls(model, settings.config, **where, **kwargs)
    e = checks.doc["engine"]
    for one in _engines(engine):
        if "decode_while_building" in e:
            one.decode_while_building = e["decode_while_building"]
        checks.refuse_fingerprint(one.spec)  # the engine's own spec is the one that counts
    return engine


def _read_verified_leaves(checks: _RestoreChecks, fresh_with_path) -> list[np.ndarray]:
    """Read the saved leaves with orbax onto the host and verify each one's shape, dtype and crc32.

    Args:
      checks: the restore's checkpoint.
      fresh_with_path: the fresh cache's leaves with their key paths (already matched by `refuse_leaves`).
    Returns:
      the leaves as host arrays, in flatten order (the zero-size ones rebuilt, as they are not stored).
    Raises:
      EngineCheckpointError: orbax cannot read the arrays, a leaf is missing, or its shape, dtype or
        crc32 differs from the saved one.
    """
    metas = checks.doc["leaves"]
    target = {
        _leaf_key(i): np.zeros(fresh.shape, jnp.dtype(m["dtype"]))
        for i, ((_, fresh), m) in enumerate(zip(fresh_with_path, metas, strict=True))
        if m["stored"]
    }
    restored = _orbax_restore(checks.path / checks.doc["cache_dir"], target)
    return [
        _verified_leaf(i, jax.tree_util.keystr(kp), fresh, m, restored)
        for i, ((kp, fresh), m) in enumerate(zip(fresh_with_path, metas, strict=True))
    ]


def _orbax_restore(arrays: Path, target: dict[str, np.ndarray]) -> Any:
    """Read the orbax checkpoint at `arrays` into host arrays shaped as `target` ({} if `target` is empty).

    Args:
      arrays: the checkpoint's array directory.
      target: {leaf key: a zero array of the leaf's shape and dtype} for the stored leaves.
    Returns:
      what orbax restored (a dict of arrays, as the save stored them).
    Raises:
      EngineCheckpointError: orbax (or tensorstore) fails to read the data, whatever it raises.
    """
    ocp, ck = _checkpointer()
    try:
        return ck.restore(arrays, args=ocp.args.StandardRestore(target)) if target else {}
    except Exception as err:  # orbax/tensorstore raise many types for missing or undecodable data
        raise EngineCheckpointError(
            f"{str(arrays)!r}: orbax could not read the cache arrays: {type(err).__name__}: {str(err)[:500]}"
        ) from err


def _verified_leaf(i: int, name: str, fresh, meta: dict[str, Any], restored: Any) -> np.ndarray:
    """Leaf `i` as restored (or, not stored, rebuilt as zeros), checked against the fresh leaf and its crc32.

    Args:
      i: the leaf's index in flatten order.
      name: its key path (`jax.tree_util.keystr`), for messages.
      fresh: the fresh cache's leaf (its shape and dtype are the expected ones).
      meta: the leaf's metadata entry.
      restored: what `_orbax_restore` returned.
    Returns:
      the leaf as a host array.
    Raises:
      EngineCheckpointError: the leaf is missing, or its shape, dtype or crc32 is not the expected one.
    """
    if meta["stored"]:
        a = restored.get(_leaf_key(i)) if isinstance(restored, dict) else None
        if a is None:
            raise EngineCheckpointError(f"leaf {i} cache{name}: missing from the orbax checkpoint")
        a = np.asarray(a)
    else:
        a = np.zeros(fresh.shape, fresh.dtype)
    # orbax casts to the target dtype silently: re-check what came back, then the bytes.
    saved = jnp.dtype(fresh.dtype if not meta["stored"] else meta["dtype"])
    if a.shape != tuple(fresh.shape) or a.dtype != saved:
        raise EngineCheckpointError(
            f"leaf {i} cache{name}: restored {a.dtype}{list(a.shape)}, expected {saved}{list(fresh.shape)}"
        )
    crc = _crc32(a)
    if crc != meta["crc32"]:
        raise EngineCheckpointError(
            f"leaf {i} cache{name}: crc32 {crc:#010x} != saved {meta['crc32']:#010x}: the array data is corrupt"
        )
    return a.view(fresh.dtype)  # a pool saved as uint16 bit patterns (a CPU layout) or as bfloat16: the same bytes


def _check_host_cache(path: Path, layout: CacheLayout, host_cache, shard: int | None = None) -> None:
    """Check the restored host cache against the engine's layout and the cache invariants.

    Args:
      path: the checkpoint directory, for the message.
      layout: the engine's `CacheLayout` (a mesh engine's: one shard's).
      host_cache: the restored cache, as host arrays (a mesh engine's: data shard `shard`'s slice).
      shard: the data shard checked, for the message (None: a single-device engine).
    Raises:
      EngineCheckpointError: a leaf does not fit the layout (`hkv.core.state.check_layout`).
      hkv.InvariantError: the cache breaks an invariant (`hkv.check_invariants`).
    """
    try:
        check_layout(layout, host_cache)
    except ValueError as err:
        where = "" if shard is None else f"data shard {shard} of the "
        raise EngineCheckpointError(f"{str(path)!r}: {where}restored cache does not fit the layout: {err}") from err
    check_invariants(layout, host_cache)  # raises hkv.InvariantError


def _install_cache(engine, treedef, fresh_with_path, host: list[np.ndarray]) -> None:
    """Replace the engine's fresh cache by the verified host leaves: free the fresh cache first (device
    memory peaks at one cache, not two), then upload each leaf to the default device, uncommitted —
    exactly how init_cache places its arrays (or where the fresh leaf was, if that differs); a leaf of a
    mesh engine's stacked cache goes from the host straight to its sharding (each device its piece).

    Args:
      engine: the engine; `engine.cache` is its fresh cache, deleted here.
      treedef: the cache's tree structure.
      fresh_with_path: the fresh cache's leaves with their key paths.
      host: the verified leaves (`_read_verified_leaves`), in the same order.
    """
    shardings = [fresh.sharding for _, fresh in fresh_with_path]
    for _, fresh in fresh_with_path:
        if not fresh.is_deleted():
            fresh.delete()
    engine.cache = None
    leaves = []
    for a, sh in zip(host, shardings, strict=True):
        if len(sh.device_set) > 1:  # a mesh engine's leaf: each device gets its own piece from the host
            leaves.append(jax.device_put(a, sh))
            continue
        leaf = jnp.asarray(a)
        leaves.append(leaf if leaf.sharding == sh else jax.device_put(leaf, sh))
    engine.cache = jax.tree_util.tree_unflatten(treedef, leaves)
