"""Warm restart (hkv.engine.checkpoint): an engine saved after a conversation turn and restored into a new
engine has a bit-identical, invariant-clean cache, serves the next turn from its prefix records with
exactly the original's output, and every way a checkpoint can be wrong raises a named error."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hkv
from hkv.core import layout as layout_module
from hkv.core.policy import RetentionPolicy
from hkv.engine import checkpoint as hc
from models.deepseek_v4 import init, tiny_config

CFG = tiny_config()
BT = 16
PROMPT = np.random.default_rng(7).integers(0, CFG.vocab_size, 100).tolist()
NEW = 6
SALT = b"tenant-7"


def make_engine(model, **kw):
    """The engine of test_prefix.py (same static shapes, so the suite compiles its programs once)."""
    base = hkv.CacheConfig(slots=2, max_context=352, page_size=8)
    layout = hkv.CacheLayout(model.cache_spec(block_tokens=BT), base)
    pages = tuple(layout.reserved_pages(g) * 4 for g in range(len(layout.groups)))  # room for cached blocks
    config = hkv.CacheConfig(slots=2, max_context=352, page_size=8, pool_pages=pages, prefix_records=96)
    return hkv.Engine(
        model,
        config,
        block_tokens=BT,
        prefill_chunk=BT,
        retention=RetentionPolicy(every_n_blocks=2),
        cache_salt=SALT,
        **kw,
    )


def host_leaves(cache):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(cache))]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit equality (NaN payloads and -0.0 included), dtype and shape too."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def model():
    return init(CFG, seed=0)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """(original engine after turn 1, its generation, the checkpoint path, host copy of the saved cache)."""
    engine = make_engine(model)
    (gen,) = engine.generate([PROMPT], NEW, return_logits=True)
    path = tmp_path_factory.mktemp("ckpt") / "engine"
    engine.save(path)  # the public wrapper of hc.save_engine
    return engine, gen, path, host_leaves(engine.cache)


@pytest.fixture(scope="module")
def restored(model, saved):
    _, _, path, _ = saved
    return hkv.Engine.restore(path, model)


def copy_ckpt(saved, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(saved[2], dst)
    return dst


def edit_metadata(path: Path, edit, reseal: bool = True) -> None:
    f = path / hc.METADATA_FILE
    doc = json.loads(f.read_text())
    edit(doc)
    if reseal:
        doc["metadata_crc32"] = hc._seal(doc)
    f.write_text(json.dumps(doc))


# --------------------------------------------------------------------------------- round trip
def test_restored_cache_is_bit_identical_and_invariant_clean(saved, restored):
    engine, _, path, want = saved
    hkv.check_invariants(restored.layout, restored.cache)
    got = host_leaves(restored.cache)
    assert len(got) == len(want)
    assert all(same_bits(g, w) for g, w in zip(got, want, strict=True))
    fresh = hkv.init_cache(restored.layout)
    for g, f in zip(jax.tree_util.tree_leaves(restored.cache), jax.tree_util.tree_leaves(fresh), strict=True):
        assert g.sharding == f.sharding  # default device, like init_cache
    # host-side settings came back too
    assert restored.layout.config == engine.layout.config
    assert restored.spec == engine.spec and restored.spec.fingerprint() == engine.spec.fingerprint()
    assert (restored.prefill_chunk, restored.retention, restored.cache_salt) == (BT, RetentionPolicy(2), SALT)
    assert int(restored.stats()["cache"]["records_created"]) > 0
    # the metadata is plain JSON; nothing is pickled
    doc = hc.read_metadata(path)
    assert doc["engine"]["cache_salt"] == SALT.hex() and doc["config"]["prefix_records"] == 96
    assert not [p for p in Path(path).rglob("*") if p.suffix in (".pkl", ".pickle")]
    assert not [p for p in Path(path).parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_second_turn_restores_its_prefix_and_matches_the_original(saved, restored):
    engine, gen, _, _ = saved
    turn2 = PROMPT + gen.tokens + [5, 17, 99, 3]
    (a,) = engine.generate([turn2], 4, return_logits=True)
    (b,) = restored.generate([turn2], 4, return_logits=True)
    assert b.plan.restored_tokens > 0
    assert b.plan.restored_tokens == a.plan.restored_tokens
    assert b.tokens == a.tokens
    assert np.abs(b.logits - a.logits).max() <= 1e-5
    hkv.check_invariants(restored.layout, restored.cache)


@pytest.mark.parametrize("saved_bits, restored_bits", [(True, True), (False, True), (True, False)])
def test_bfloat16_pools_with_nan_payloads_round_trip_bit_exact(tmp_path, monkeypatch, saved_bits, restored_bits):
    """bfloat16 storage (the production dtype) through orbax: every bit, NaN payloads and -0.0 too, from
    and into pools held as uint16 bit patterns (a CPU layout, `CacheLayout.pool_bits`) or as bfloat16
    (a GPU / TPU one)."""
    bf = init(CFG, seed=0, dtype=jnp.bfloat16)
    monkeypatch.setattr(layout_module, "default_pool_bits", lambda: saved_bits)
    engine = make_engine(bf, model_id="tiny-bf16")
    rng = np.random.default_rng(1)
    groups = []
    for g in engine.cache.groups:
        bits = rng.integers(0, 2**16, g.pool.shape, dtype=np.uint16)
        bits.flat[:3] = (0x7FC1, 0x8000, 0xFF81)  # NaN with payload, -0.0, negative NaN
        groups.append(g.replace(pool=jnp.asarray(bits if saved_bits else bits.view(ml_dtypes.bfloat16))))
    engine.cache = engine.cache.replace(groups=tuple(groups))
    pool_dtype = {True: np.dtype(np.uint16), False: np.dtype(ml_dtypes.bfloat16)}
    assert engine.cache.groups[0].pool.dtype == pool_dtype[saved_bits]
    want = host_leaves(engine.cache)
    hc.save_engine(engine, tmp_path / "bf")
    monkeypatch.setattr(layout_module, "default_pool_bits", lambda: restored_bits)
    back = hkv.Engine.restore(tmp_path / "bf", bf)
    assert {g.pool.dtype for g in back.cache.groups} == {pool_dtype[restored_bits]}
    got = host_leaves(back.cache)
    assert all(same_bits(g.view(w.dtype), w) for g, w in zip(got, want, strict=True))
    assert back.spec.model_id == "tiny-bf16" and back.spec.dtype == "bfloat16"
    # the same checkpoint does not restore into a float32 model: different ABI
    with pytest.raises(hc.EngineCheckpointError, match="dtype"):
        hkv.Engine.restore(tmp_path / "bf", init(CFG, seed=0))


# ------------------------------------------------------------------------------ named errors
def test_abi_mismatch_is_refused_naming_both_fingerprints(model, saved, tmp_path):
    path = saved[2]
    saved_fp = saved[0].spec.fingerprint()
    other_weights = init(CFG, seed=1)  # same config, other weights
    with pytest.raises(hc.EngineCheckpointError, match=r"fingerprint mismatch.*weights_digest") as e:
        hkv.Engine.restore(path, other_weights)
    other = make_engine(other_weights).spec.fingerprint()
    assert other != saved_fp and saved_fp in str(e.value) and other in str(e.value)
    wider = init(tiny_config(sliding_window=16), seed=0)
    with pytest.raises(hc.EngineCheckpointError, match=r"fingerprint mismatch.*layers"):
        hkv.Engine.restore(path, wider)
    # model_id is a label: another label on the same weights restores, and the label is the new one
    relabelled = hkv.Engine.restore(path, model, model_id="other")
    assert relabelled.spec.model_id == "other" and relabelled.spec.fingerprint() == saved_fp
    # the caller's own overrides are named as the cause (not the weights), before any engine is built
    assert "weights (bit for bit)" in str(e.value)
    with pytest.raises(
        hc.EngineCheckpointError, match=r"block_tokens: 16 -> 8.*restore without overriding block_tokens"
    ):
        hkv.Engine.restore(path, model, block_tokens=8)
    other_config = hkv.CacheConfig(slots=3, max_context=352, page_size=8)
    with pytest.raises(hc.EngineCheckpointError, match="config cannot be overridden"):  # was "multiple values"
        hkv.Engine.restore(path, model, config=other_config)


def test_corrupt_or_unknown_metadata_is_refused(model, saved, tmp_path):
    path = copy_ckpt(saved, tmp_path)
    f = path / hc.METADATA_FILE
    good = f.read_text()
    f.write_text(good[: len(good) // 2])  # truncated JSON
    with pytest.raises(hc.EngineCheckpointError, match="corrupt metadata"):
        hkv.Engine.restore(path, model)
    f.write_text(good)
    edit_metadata(path, lambda d: d.update(version=99))
    with pytest.raises(hc.EngineCheckpointError, match="unknown version=99"):
        hkv.Engine.restore(path, model)
    f.write_text(good)
    # version 2: the same files, but prefix records of whole-context page rows (before issue 47 item 2)
    edit_metadata(path, lambda d: d.update(version=2))
    with pytest.raises(hc.EngineCheckpointError, match="version-2 checkpoint: its prefix records hold a page row"):
        hkv.Engine.restore(path, model)
    f.write_text(good)
    edit_metadata(path, lambda d: d["config"].update(slots=3), reseal=False)  # valid JSON, edited
    with pytest.raises(hc.EngineCheckpointError, match="metadata_crc32"):
        hkv.Engine.restore(path, model)
    f.write_text(good)
    edit_metadata(path, lambda d: d["engine"].pop("prefill_chunk"))
    with pytest.raises(hc.EngineCheckpointError, match=r"missing field engine.'prefill_chunk'"):
        hkv.Engine.restore(path, model)
    f.unlink()
    with pytest.raises(hc.EngineCheckpointError, match="missing"):
        hkv.Engine.restore(path, model)
    with pytest.raises(hc.EngineCheckpointError, match="not a directory"):
        hkv.Engine.restore(tmp_path / "nowhere", model)


def test_corrupt_arrays_are_detected(model, saved, tmp_path):
    # 1. a flipped byte in orbax's (compressed) data: orbax reads it back without complaint or fails
    #    to decode it; either way the restore refuses
    path = copy_ckpt(saved, tmp_path)
    data = max(
        (p for p in hc.cache_dir(path).rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(hc.EngineCheckpointError, match=r"crc32|could not read"):
        hkv.Engine.restore(path, model)
    # 2. a checksum that disagrees with the stored bytes names the leaf
    path2 = tmp_path / "copy2"
    shutil.copytree(saved[2], path2)
    doc = json.loads((path2 / hc.METADATA_FILE).read_text())
    i = next(k for k, m in enumerate(doc["leaves"]) if ".prefix.key" in m["path"])
    edit_metadata(path2, lambda d: d["leaves"][i].update(crc32=(d["leaves"][i]["crc32"] + 1) % 2**32))
    with pytest.raises(hc.EngineCheckpointError, match=r"leaf \d+ cache\.prefix\.key: crc32"):
        hkv.Engine.restore(path2, model)
    # 3. a declared dtype that differs from the engine's (orbax itself would silently cast)
    shutil.rmtree(path2)
    shutil.copytree(saved[2], path2)
    edit_metadata(path2, lambda d: d["leaves"][i].update(dtype="int32"))
    with pytest.raises(hc.EngineCheckpointError, match=r"prefix\.key int32"):
        hkv.Engine.restore(path2, model)
    # 4. the array directory is gone
    shutil.rmtree(path2)
    shutil.copytree(saved[2], path2)
    shutil.rmtree(hc.cache_dir(path2))
    with pytest.raises(hc.EngineCheckpointError, match="could not read"):
        hkv.Engine.restore(path2, model)


def test_invariant_violation_is_refused(model, saved, tmp_path, monkeypatch):
    """A checkpoint whose arrays are intact but whose state breaks an invariant is not installed."""
    engine = saved[0]
    bad = engine.cache.replace(lengths=engine.cache.lengths.at[0].set(7))  # inactive slot with a length
    monkeypatch.setattr(engine, "cache", bad)
    hc.save_engine(engine, tmp_path / "bad")
    with pytest.raises(hkv.InvariantError, match="inactive slots"):
        hkv.Engine.restore(tmp_path / "bad", model)


def test_save_refuses_while_running_and_overwrite_needs_consent(model, saved, restored, tmp_path):
    path = tmp_path / "ck"
    hc.save_engine(restored, path)
    with pytest.raises(hc.EngineCheckpointError, match="already exists"):
        hc.save_engine(restored, path)
    hc.save_engine(restored, path, overwrite=True)
    assert hc.read_metadata(path)["abi_fingerprint"] == restored.spec.fingerprint()
    other = tmp_path / "not-a-checkpoint"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(hc.EngineCheckpointError, match="not an hkv engine checkpoint"):
        hc.save_engine(restored, other, overwrite=True)
    assert (other / "precious.txt").read_text() == "keep me"

    # mid-generation: the progress callback fires while the first prompt is running
    errors = []

    def try_save(msg):
        if restored.scheduler.running:
            with pytest.raises(hc.EngineCheckpointError, match="running") as e:
                hc.save_engine(restored, tmp_path / "mid")
            errors.append(str(e.value))

    restored.progress = try_save
    try:
        restored.generate([PROMPT[:40], PROMPT[:20]], 2, return_logits=True)
    finally:
        restored.progress = None
    assert errors and not (tmp_path / "mid").exists()
    assert sorted(os.listdir(tmp_path)) == ["ck", "not-a-checkpoint"]  # no temp dirs left behind


# --------------------------------------------------------------- bounded parsing (issue 11 #10)
def test_hostile_metadata_files_are_named_errors_never_crashes(model, saved, tmp_path):
    """Regression (issue 11 #10): a deeply nested hkv_engine.json raised RecursionError (and a huge
    integer ValueError, non-UTF-8 bytes UnicodeDecodeError) instead of EngineCheckpointError."""
    path = copy_ckpt(saved, tmp_path)
    f = path / hc.METADATA_FILE
    good = f.read_text()
    cases = {
        "[" * 100_000 + "]" * 100_000: "corrupt metadata.*RecursionError",
        '{"format": ' + "9" * 50_000 + "}": "corrupt metadata",
        b'{"format": "\xff\xfe"}': "corrupt metadata.*UnicodeDecodeError",
        '{"format": NaN}': "corrupt metadata",
        "[]": "a list, not a JSON object",
    }
    for text, match in cases.items():
        f.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(hc.EngineCheckpointError, match=match):
            hc.read_metadata(path)
        with pytest.raises(hc.EngineCheckpointError, match=match):
            hkv.Engine.restore(path, model)
    # nesting the parser accepts but the schema never has, sealed: refused before anything recurses on it
    f.write_text(good)
    edit_metadata(path, lambda d: d["spec"].update(extra=json.loads("[" * 500 + "]" * 500)))
    with pytest.raises(hc.EngineCheckpointError, match=f"more than MAX_JSON_DEPTH={hc.MAX_JSON_DEPTH}"):
        hc.read_metadata(path)
    # a file past the size cap is not even parsed
    f.write_text(good[:-1] + " " * hc.MAX_METADATA_BYTES + "}")
    with pytest.raises(hc.EngineCheckpointError, match="more than MAX_METADATA_BYTES"):
        hc.read_metadata(path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda d: d["config"].update(slots=10**30),
            r"config.slots=1000000000000000000000000000000 is invalid: "
            r"want an integer in \[1, 65536\]",
        ),
        (lambda d: d["config"].update(max_context=True), r"config.max_context=True is invalid"),
        (lambda d: d["config"].update(pool_pages=[1] * 1000), r"config.pool_pages=.* null or a list of 1 to 256"),
        (lambda d: d["leaves"][3].update(shape=[2**62]), r"leaves\[3\].shape\[0\]=4611686018427387904 is invalid"),
        (lambda d: d["leaves"][3].update(shape=[2**30] * 3), r"leaves\[3\].shape=.* at most 281474976710656 elements"),
        (lambda d: d["leaves"][0].update(dtype="object"), r"leaves\[0\].dtype='object' is invalid"),
        (
            lambda d: d["leaves"][0].update(crc32=-1),
            r"leaves\[0\].crc32=-1 is invalid: want an integer in \[0, 4294967295\]",
        ),
        (
            lambda d: d["engine"]["retention"].update(keep_everything=True),
            r"unknown field engine.retention.'keep_everything'",
        ),
        (lambda d: d["engine"].update(cache_salt="abc"), r"engine.cache_salt='abc' is invalid"),
        (lambda d: d.update(cache_dir="../../etc"), r"cache_dir='../../etc' is invalid"),
        (lambda d: d.update(abi_fingerprint="x" * 10**6), r"abi_fingerprint='xxx.*\(1000002 chars\) is invalid"),
        (lambda d: d.pop("leaves"), r"missing field 'leaves'"),
        (lambda d: d["spec"].update(weights_digest=None), r"spec.weights_digest=None is invalid"),
    ],
)
def test_every_field_is_type_and_range_checked(model, saved, tmp_path, edit, match):
    path = copy_ckpt(saved, tmp_path)
    edit_metadata(path, edit)
    with pytest.raises(hc.EngineCheckpointError, match=match):
        hc.read_metadata(path)


def to_version_1(path: Path) -> None:
    """Rewrite a checkpoint as hkv wrote version 1: arrays in cache/, no cache_dir, no weights digest."""
    os.rename(hc.cache_dir(path), path / hc.CACHE_DIR)

    def edit(d):
        d.update(version=1)
        d.pop("cache_dir")
        d["spec"].pop("weights_digest")

    edit_metadata(path, edit)


def test_version_1_checkpoint_is_read_but_refused_and_overwritten(model, saved, restored, tmp_path):
    path = copy_ckpt(saved, tmp_path)
    to_version_1(path)
    doc = hc.read_metadata(path)
    assert doc["version"] == 1 and hc.cache_dir(path) == path / hc.CACHE_DIR
    with pytest.raises(
        hc.EngineCheckpointError,
        match="version-1 checkpoint: its ABI fingerprint covers the label model_id='unknown', not the weights",
    ):
        hkv.Engine.restore(path, model)
    # saving over it (overwrite=True) gives a version-2 checkpoint, and the old arrays are gone
    restored.save(path, overwrite=True)
    assert hc.read_metadata(path)["version"] == hc.FORMAT_VERSION
    assert sorted(os.listdir(path)) == sorted([hc.METADATA_FILE, hc.cache_dir(path).name])
    hkv.Engine.restore(path, model)


def test_overwrite_keeps_one_version_and_cleans_only_our_stale_entries(restored, tmp_path):
    path = tmp_path / "ck"
    restored.save(path)
    first = hc.cache_dir(path).name
    # leftovers of killed saves (ours by name) and things that are not ours
    (path / "cache-0123456789abcdef0123456789abcdef.orbax-checkpoint-tmp-17").mkdir()
    (path / f".{hc.METADATA_FILE}.tmp-{'a' * 32}").write_text("{")
    (tmp_path / f".ck.tmp-{'b' * 32}").mkdir()
    (tmp_path / ".ck.old-0123456789ab").mkdir()  # what hkv's version-1 save left when killed
    (path / "notes.txt").write_text("mine")
    (tmp_path / f".other.tmp-{'c' * 32}").mkdir()  # another checkpoint's: not ours to delete
    past = time.time() - 60
    for p in list(path.iterdir()) + list(tmp_path.iterdir()):
        os.utime(p, (past, past))
    restored.save(path, overwrite=True)
    second = hc.cache_dir(path).name
    assert second != first
    assert sorted(os.listdir(path)) == sorted([hc.METADATA_FILE, second, "notes.txt"])
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", f".other.tmp-{'c' * 32}"])
    # an entry of our pattern modified after the save began (another save writing it) is left alone
    young = path / f"cache-{'d' * 32}"
    young.mkdir()
    os.utime(young, (time.time() + 60, time.time() + 60))
    restored.save(path, overwrite=True)
    assert young.exists()


def test_leftovers_of_a_killed_first_save_do_not_block_the_next(model, restored, saved, tmp_path):
    """A save into an empty directory killed before its metadata switch leaves only our entries: the
    directory is no checkpoint (restore refuses), and overwrite=True may reuse it; a version-1 save
    killed between its renames left the old checkpoint beside the path: restore names it."""
    path = tmp_path / "ck"
    path.mkdir()
    (path / f"cache-{'e' * 32}").mkdir()
    (path / f"cache-{'f' * 32}.orbax-checkpoint-tmp-3").mkdir()
    with pytest.raises(hc.EngineCheckpointError, match="not an hkv engine checkpoint"):
        hkv.Engine.restore(path, model)
    past = time.time() - 60
    for p in path.iterdir():
        os.utime(p, (past, past))
    restored.save(path, overwrite=True)
    assert sorted(os.listdir(path)) == sorted([hc.METADATA_FILE, hc.cache_dir(path).name])
    lost = tmp_path / "lost"
    shutil.copytree(saved[2], tmp_path / ".lost.old-0123456789ab")
    with pytest.raises(
        hc.EngineCheckpointError,
        match=r"not a directory\); .*\.lost\.old-0123456789ab' is the "
        r"checkpoint an interrupted save",
    ):
        hkv.Engine.restore(lost, model)


def test_a_restored_engine_with_prefix_records_builds_the_prefix_lookup_ahead(model, saved):
    """`Engine.restore` of a cache holding prefix records starts building the lookup's restore step
    in the background (speculative), so the first request that hits a restored prefix does not
    compile it on its path. (Last in the module: it drops the compiled steps, as a new process.)"""
    from hkv.engine import compiled

    _, gen, path, _ = saved
    compiled.clear()  # as in a new process: no step traced yet
    back = hkv.Engine.restore(path, model)
    compiled.wait_for_ahead()
    traces = back._steps.traces
    assert traces["restore"] == 1
    (b,) = back.generate([PROMPT + gen.tokens + [5, 17, 99, 3]], 4)
    assert b.plan.restored_tokens > 0
    assert traces["restore"] == 1  # used, not built again
