"""Warm restart: save a whole `Engine` (its `HybridCache` and the host-side settings that rebuild it)
and restore it so a restarted server resumes with its device cache — running state, prefix records,
TAIL snapshots, counters — intact and verified.

On disk, `path` is a directory:
    hkv_engine.json   the metadata (plain JSON, no pickle): format name + version, the `CacheConfig`
                      fields, block_tokens, prefill_chunk, model_id, retention policy, cache salt (hex),
                      the ABI fingerprint and the spec it hashes, and one entry per cache leaf in
                      `jax.tree_util` flatten order — key path, shape, dtype, crc32 of its bytes —
                      sealed by a crc32 of the whole document.
    cache/            an orbax-checkpoint (StandardCheckpointHandler) of the cache's leaves as a flat
                      dict {"leaf_00000": array, ...}; zero-size leaves (e.g. the overlap slice of a
                      non-overlapping compressor, [S, 0, D]) are not stored — orbax refuses them — and
                      are rebuilt from the fresh cache on restore.

`restore_engine` trusts nothing it reads: the JSON is schema-checked, the rebuilt engine's ABI
fingerprint must equal the saved one, every leaf's shape and dtype must equal the fresh cache's
(orbax would silently cast a dtype), every leaf's crc32 must match (orbax does not notice a
flipped byte in its compressed data files), and `hkv.check_invariants` must hold before the cache
is installed. Any failure raises; a half-restored engine is never returned.

Saving writes into a temporary directory next to `path` and renames it into place, so a crash
never leaves a partial checkpoint at `path`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .invariants import check_invariants
from .policy import RetentionPolicy
from .state import CacheConfig, check_layout

FORMAT_NAME = "hkv-engine-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "hkv_engine.json"
CACHE_DIR = "cache"

__all__ = ["EngineCheckpointError", "save_engine", "restore_engine", "read_metadata",
           "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILE"]


class EngineCheckpointError(ValueError):
    """An engine checkpoint cannot be written or used: missing/corrupt/unknown-version metadata, an ABI
    fingerprint that differs from the restoring engine's, leaves whose shape, dtype or checksum differ,
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


def _is_replaceable(p: Path) -> bool:
    """`overwrite=True` only ever deletes an empty directory or a previous engine checkpoint."""
    return p.is_dir() and (not any(p.iterdir()) or (p / METADATA_FILE).is_file())


# --------------------------------------------------------------------------------------- save
def save_engine(engine, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Save `engine` (an idle `hkv.Engine`) to the directory `path`; see the module docstring.

    Stores `engine.cache` (every leaf, bit-exact) with orbax and the settings that rebuild the engine
    (`engine.layout.config`, `engine.spec.block_tokens`, `engine.prefill_chunk`,
    `engine.spec.model_id`, `engine.retention`, `engine.cache_salt`) plus the ABI fingerprint and one
    crc32 per leaf in JSON. The model weights are not saved: `restore_engine` takes the model.

    Raises `EngineCheckpointError` if sequences are running (`engine.generate` in progress: their
    host-side state is not part of the checkpoint) or if `path` exists and `overwrite` is False;
    with `overwrite=True` an existing checkpoint (or empty directory) at `path` is replaced, never
    any other directory. The write is atomic: a temporary directory next to `path`, renamed into place.
    """
    path = Path(os.fspath(path)).absolute()
    running = getattr(engine, "_running", {})
    if running:
        raise EngineCheckpointError(
            f"cannot save while {len(running)} sequence(s) are running (slots {sorted(running)}); "
            f"save between generate() calls")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise EngineCheckpointError(f"{str(path)!r} already exists; pass overwrite=True to replace it")
        if not _is_replaceable(path):
            raise EngineCheckpointError(f"{str(path)!r} exists and is not an hkv engine checkpoint or an empty "
                                        f"directory; refusing to overwrite it")

    cfg = engine.layout.config
    leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(engine.cache)
    host = [np.asarray(jax.device_get(x)) for _, x in leaves_with_path]  # one device->host copy
    leaf_meta, stored = [], {}
    for i, ((kp, _), a) in enumerate(zip(leaves_with_path, host)):
        keep = a.size > 0  # orbax refuses zero-size arrays; they carry no data
        leaf_meta.append({"path": jax.tree_util.keystr(kp), "shape": list(a.shape), "dtype": a.dtype.name,
                          "crc32": _crc32(a), "stored": keep})
        if keep:
            stored[_leaf_key(i)] = a
    ret = engine.retention
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "config": {
            "slots": cfg.slots, "max_context": cfg.max_context, "page_size": cfg.page_size,
            "pool_pages": None if cfg.pool_pages is None else [int(p) for p in cfg.pool_pages],
            "prefix_records": cfg.prefix_records, "tail_snapshots": cfg.tail_snapshots,
        },
        "engine": {
            "block_tokens": engine.spec.block_tokens, "prefill_chunk": engine.prefill_chunk,
            "model_id": engine.spec.model_id,
            "retention": {f.name: getattr(ret, f.name) for f in dataclasses.fields(ret)},
            "cache_salt": bytes(engine.cache_salt).hex(),
        },
        "abi_fingerprint": engine.spec.fingerprint(),
        "spec": engine.spec.to_json(),
        "leaves": leaf_meta,
        "versions": {"jax": jax.__version__, "orbax_checkpoint": _orbax_version()},
    }
    doc["metadata_crc32"] = _seal(doc)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        tmp.mkdir()
        ocp, ck = _checkpointer()
        ck.save(tmp / CACHE_DIR, args=ocp.args.StandardSave(stored))
        with open(tmp / METADATA_FILE, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if path.exists() or path.is_symlink():  # overwrite=True, checked above: swap, then delete the old
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _orbax_version() -> str:
    try:
        import orbax.checkpoint as ocp

        return str(getattr(ocp, "__version__", "unknown"))
    except Exception:  # pragma: no cover
        return "unknown"


# ------------------------------------------------------------------------------------ restore
def _need(d: Any, key: str, types, where: str):
    if not isinstance(d, dict) or key not in d:
        raise EngineCheckpointError(f"checkpoint metadata: missing field {where}{key!r}")
    v = d[key]
    wanted = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, wanted) or (isinstance(v, bool) and bool not in wanted):  # JSON true is not an int
        raise EngineCheckpointError(f"checkpoint metadata: field {where}{key}={v!r} has the wrong type "
                                    f"(want {types})")
    return v


def read_metadata(path: str | os.PathLike) -> dict:
    """The schema-checked metadata dict of the engine checkpoint at `path` (see the module docstring).

    Raises `EngineCheckpointError` when the file is missing, not JSON, of another format or an unknown
    version, fails its crc32 seal, or lacks / mistypes a field.
    """
    f = Path(os.fspath(path)) / METADATA_FILE
    if not f.is_file():
        raise EngineCheckpointError(f"{str(path)!r} is not an hkv engine checkpoint: {METADATA_FILE} missing")
    try:
        doc = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineCheckpointError(f"{str(f)!r}: corrupt metadata ({e})") from e
    if not isinstance(doc, dict):
        raise EngineCheckpointError(f"{str(f)!r}: metadata is a {type(doc).__name__}, not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise EngineCheckpointError(f"{str(f)!r}: format={doc.get('format')!r}, expected {FORMAT_NAME!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise EngineCheckpointError(f"{str(f)!r}: unknown version={doc.get('version')!r} "
                                    f"(this hkv reads version {FORMAT_VERSION})")
    seal = doc.get("metadata_crc32")
    if seal != _seal(doc):
        raise EngineCheckpointError(f"{str(f)!r}: metadata_crc32={seal!r} does not match its contents "
                                    f"({_seal(doc)}): the file was edited or corrupted")
    cfg = _need(doc, "config", dict, "")
    for k in ("slots", "max_context", "page_size", "prefix_records"):
        _need(cfg, k, int, "config.")
    _need(cfg, "pool_pages", (list, type(None)), "config.")
    _need(cfg, "tail_snapshots", (int, type(None)), "config.")
    if cfg["pool_pages"] is not None and not all(isinstance(p, int) and not isinstance(p, bool)
                                                 for p in cfg["pool_pages"]):
        raise EngineCheckpointError(f"checkpoint metadata: config.pool_pages={cfg['pool_pages']!r} must be ints")
    eng = _need(doc, "engine", dict, "")
    for k in ("block_tokens", "prefill_chunk"):
        _need(eng, k, int, "engine.")
    _need(eng, "model_id", str, "engine.")
    _need(eng, "retention", dict, "engine.")
    salt = _need(eng, "cache_salt", str, "engine.")
    try:
        bytes.fromhex(salt)
    except ValueError as e:
        raise EngineCheckpointError(f"checkpoint metadata: engine.cache_salt={salt!r} is not hex") from e
    _need(doc, "abi_fingerprint", str, "")
    _need(doc, "spec", dict, "")
    leaves = _need(doc, "leaves", list, "")
    for i, m in enumerate(leaves):
        _need(m, "path", str, f"leaves[{i}].")
        _need(m, "shape", list, f"leaves[{i}].")
        _need(m, "dtype", str, f"leaves[{i}].")
        _need(m, "crc32", int, f"leaves[{i}].")
        _need(m, "stored", bool, f"leaves[{i}].")
    return doc


def _abi_diff(saved: dict, now: dict) -> str:
    """Which spec fields differ (for the ABI mismatch message)."""
    diff = [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if k != "layers" and saved.get(k) != now.get(k)]
    if saved.get("layers") != now.get("layers"):
        diff.append("layers (dims / windows / compressor ratios)")
    return "; ".join(diff) or "no spec field (fingerprint algorithm changed?)"


def restore_engine(path: str | os.PathLike, model, **engine_kwargs):
    """Rebuild the `hkv.Engine` saved at `path` around `model` and install its verified cache.

    model: the same weights the engine was saved with (they are not in the checkpoint; `model_id`
    and the model's dims/dtype enter the ABI fingerprint, which must match the saved one).
    engine_kwargs: passed to `hkv.Engine`; they override the saved block_tokens, prefill_chunk,
    model_id, retention, cache_salt and add runtime options (progress, kernel_options).

    Steps, each raising before anything is installed: schema-check the metadata
    (`EngineCheckpointError`); build the engine from the saved `CacheConfig`; compare ABI
    fingerprints (`EngineCheckpointError` naming both and the differing spec fields); check every
    leaf's key path, shape and dtype against the fresh `engine.cache`; read the leaves with orbax onto
    the host; verify each leaf's crc32 (`EngineCheckpointError` naming the leaf); run
    `hkv.state.check_layout` and `hkv.check_invariants` (`hkv.InvariantError`) on that host copy; only
    then free the fresh cache and upload the verified leaves to the default device, uncommitted, as
    `init_cache` places them (device memory never holds two caches). Returns the engine with
    `engine.cache` = the restored cache.
    """
    from .engine import Engine

    path = Path(os.fspath(path)).absolute()
    if not path.is_dir():
        raise EngineCheckpointError(f"no engine checkpoint at {str(path)!r} (not a directory)")
    doc = read_metadata(path)
    c, e = doc["config"], doc["engine"]
    try:
        config = CacheConfig(slots=c["slots"], max_context=c["max_context"], page_size=c["page_size"],
                             pool_pages=None if c["pool_pages"] is None else tuple(c["pool_pages"]),
                             prefix_records=c["prefix_records"], tail_snapshots=c["tail_snapshots"])
        retention = RetentionPolicy(**e["retention"])
    except (TypeError, ValueError) as err:
        raise EngineCheckpointError(f"{str(path)!r}: invalid saved config/retention: {err}") from err
    kwargs = dict(block_tokens=e["block_tokens"], prefill_chunk=e["prefill_chunk"], model_id=e["model_id"],
                  retention=retention, cache_salt=bytes.fromhex(e["cache_salt"]))
    kwargs.update(engine_kwargs)
    engine = Engine(model, config, **kwargs)

    saved_fp, new_fp = doc["abi_fingerprint"], engine.spec.fingerprint()
    if saved_fp != new_fp:
        raise EngineCheckpointError(
            f"ABI fingerprint mismatch: checkpoint {str(path)!r} was saved with {saved_fp}, this model/engine "
            f"gives {new_fp} (differs in {_abi_diff(doc['spec'], engine.spec.to_json())}); restore with the "
            f"same weights, dtype and model_id")

    fresh_with_path, treedef = jax.tree_util.tree_flatten_with_path(engine.cache)
    metas = doc["leaves"]
    if len(metas) != len(fresh_with_path):
        raise EngineCheckpointError(f"checkpoint has {len(metas)} cache leaves; this engine's cache has "
                                    f"{len(fresh_with_path)}")
    target = {}
    for i, ((kp, fresh), m) in enumerate(zip(fresh_with_path, metas)):
        name = jax.tree_util.keystr(kp)
        if m["path"] != name or tuple(m["shape"]) != tuple(fresh.shape) or m["dtype"] != fresh.dtype.name:
            raise EngineCheckpointError(
                f"leaf {i}: checkpoint has cache{m['path']} {m['dtype']}{m['shape']}, this engine needs "
                f"cache{name} {fresh.dtype.name}{list(fresh.shape)}")
        if m["stored"] != (fresh.size > 0):
            raise EngineCheckpointError(f"leaf {i} cache{name}: stored={m['stored']!r} but its size is {fresh.size}")
        if m["stored"]:
            target[_leaf_key(i)] = np.zeros(fresh.shape, fresh.dtype)

    ocp, ck = _checkpointer()
    try:
        restored = ck.restore(path / CACHE_DIR, args=ocp.args.StandardRestore(target)) if target else {}
    except Exception as err:  # orbax/tensorstore raise many types for missing or undecodable data
        raise EngineCheckpointError(f"{str(path / CACHE_DIR)!r}: orbax could not read the cache arrays: "
                                    f"{type(err).__name__}: {str(err)[:500]}") from err

    host = []
    for i, ((kp, fresh), m) in enumerate(zip(fresh_with_path, metas)):
        name = jax.tree_util.keystr(kp)
        if m["stored"]:
            a = restored.get(_leaf_key(i)) if isinstance(restored, dict) else None
            if a is None:
                raise EngineCheckpointError(f"leaf {i} cache{name}: missing from the orbax checkpoint")
            a = np.asarray(a)
        else:
            a = np.zeros(fresh.shape, fresh.dtype)
        # orbax casts to the target dtype silently: re-check what came back, then the bytes.
        if a.shape != tuple(fresh.shape) or a.dtype != fresh.dtype:
            raise EngineCheckpointError(f"leaf {i} cache{name}: restored {a.dtype}{list(a.shape)}, expected "
                                        f"{fresh.dtype}{list(fresh.shape)}")
        crc = _crc32(a)
        if crc != m["crc32"]:
            raise EngineCheckpointError(f"leaf {i} cache{name}: crc32 {crc:#010x} != saved {m['crc32']:#010x}: "
                                        f"the array data is corrupt")
        host.append(a)
    # Every check runs on the host copy, before any device memory is touched.
    host_cache = jax.tree_util.tree_unflatten(treedef, host)
    try:
        check_layout(engine.layout, host_cache)
    except ValueError as err:
        raise EngineCheckpointError(f"{str(path)!r}: restored cache does not fit the layout: {err}") from err
    check_invariants(engine.layout, host_cache)  # raises hkv.InvariantError

    # Verified: free the fresh cache first (device memory peaks at one cache, not two), then upload
    # each leaf to the default device, uncommitted — exactly how init_cache places its arrays.
    shardings = [fresh.sharding for _, fresh in fresh_with_path]
    for _, fresh in fresh_with_path:
        if not fresh.is_deleted():
            fresh.delete()
    del fresh_with_path
    engine.cache = None
    leaves = []
    for a, sh in zip(host, shardings):
        leaf = jnp.asarray(a)
        leaves.append(leaf if leaf.sharding == sh else jax.device_put(leaf, sh))
    cache = jax.tree_util.tree_unflatten(treedef, leaves)
    engine.cache = cache
    return engine
