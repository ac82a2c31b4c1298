"""A structure-aware fuzzer of the engine-checkpoint metadata parser (issue 11, defect 10).

Starting from a real checkpoint's hkv_engine.json, hypothesis mutates fields — replaces a value with
a hostile one (deep nesting, huge or negative integers, wrong types, huge lists and strings, shapes
whose product overflows int64), deletes a key, adds an unknown key, grows or empties a list — then
re-seals the document with a valid `metadata_crc32` so the parser's every later check is reached.
`read_metadata` and `restore_engine` must either succeed correctly (the document read back as
written; the restored cache bit-identical to the saved one, with the settings the document states)
or raise `EngineCheckpointError` — never anything else — within a deadline.

Default: 60 documents through `read_metadata`, 25 through `restore_engine`; `slow`: 3000 and 300.
"""

from __future__ import annotations

import json
import shutil
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hkv
from hkv.core.policy import RetentionPolicy
from hkv.engine import checkpoint as hc
from models.deepseek_v4 import init, tiny_config

READ_DEADLINE_S = 5.0
RESTORE_DEADLINE_S = 60.0


class Raw:
    """JSON text spliced into the document as is (what `json.dumps` cannot or should not produce:
    10**5000, 5000 nested lists, NaN)."""

    def __init__(self, text: str):
        self.text = text


def hostile_values():
    small = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.just(""),
        st.just("cache-" + "0" * 32),
        st.just("../" * 8 + "etc"),
        st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, -(2**63)]),
    )
    nested = st.recursive(
        small,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12,
    )
    plausible = st.one_of(  # values of the right type, often in range: they reach the restore's checks
        st.integers(0, 2**31),
        st.integers(0, 64),
        st.booleans(),
        st.binary(min_size=16, max_size=16).map(lambda b: b.hex()),
        st.binary(min_size=16, max_size=16).map(lambda b: "cache-" + b.hex()),
        st.sampled_from(["float32", "bfloat16", "int32", "uint8", "float64", "int4"]),
        st.lists(st.integers(0, 64), max_size=4),
    )
    return st.one_of(
        plausible,
        plausible,
        nested,
        st.integers(1, 6000).map(lambda n: Raw("[" * n + "]" * n)),  # deep nesting
        st.integers(1, 6000).map(lambda n: Raw('{"a":' * n + "0" + "}" * n)),
        st.integers(20, 9000).map(lambda n: Raw("9" * n)),  # huge integers
        st.sampled_from(
            [
                Raw("NaN"),
                Raw("Infinity"),
                Raw("-Infinity"),
                Raw("1e999"),
                Raw("-0.0"),
                Raw('"\\ud800"'),
                Raw('"\\u0000"'),
            ]
        ),
        st.integers(1, 200_000).map(lambda n: [0] * n),  # huge lists
        st.integers(1, 100_000).map(lambda n: "x" * n),  # huge strings
        st.lists(st.sampled_from([2**31, 2**40, 2**62, 2**63, -1, 0]), min_size=1, max_size=20),  # shapes
    )


def paths(doc, prefix=()):
    """Every key path of the document (dict keys and list indices)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:8]):  # the first leaves stand for all of them
            out += paths(v, prefix + (i,))
    return out


@st.composite
def mutated_documents(draw, base: dict):
    """A copy of `base` with 1-3 structure-aware mutations, and the sealed file text for it."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([p for p in paths(doc) if p and p[0] != "metadata_crc32"]))
        parent = doc
        for k in where[:-1]:
            parent = parent[k]
        key = where[-1]
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "grow", "empty"]))
        if op == "replace":
            parent[key] = draw(hostile_values())
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=12))] = draw(hostile_values())
        elif op == "grow" and isinstance(parent[key], list):
            parent[key] = parent[key] + [draw(hostile_values())] * draw(st.integers(1, 3))
        elif op == "empty" and isinstance(parent[key], (list, dict)):
            parent[key] = type(parent[key])()
        if not isinstance(doc, dict):
            break
    return doc, seal(doc)


def seal(doc: dict) -> str:
    """The file text of `doc` with a valid seal (hc._seal's crc32 over the canonical JSON without the
    seal field), `Raw` values spliced in as written."""
    raws: list[str] = []

    def encode(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: encode(x) for k, x in v.items()}
        if isinstance(v, list):
            return [encode(x) for x in v]
        return v

    def splice(text: str) -> str:
        for i, r in enumerate(raws):
            text = text.replace(f'"@@RAW{i}@@"', r)
        return text

    enc = encode(doc)
    body = {k: v for k, v in enc.items() if k != "metadata_crc32"}
    canonical = splice(json.dumps(body, sort_keys=True, separators=(",", ":")))
    enc["metadata_crc32"] = zlib.crc32(canonical.encode("utf-8", "surrogatepass")) & 0xFFFFFFFF
    return splice(json.dumps(enc, sort_keys=True, separators=(",", ":")))


def host_leaves(cache):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(cache))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(model, the checkpoint directory, its metadata, the saved cache's host leaves)."""
    model = init(tiny_config(), seed=0)
    engine = hkv.Engine(
        model,
        hkv.CacheConfig(slots=2, max_context=64, page_size=8, prefix_records=8),
        block_tokens=16,
        prefill_chunk=16,
        retention=RetentionPolicy(every_n_blocks=2),
        cache_salt=b"fuzz",
    )
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    engine.save(path)
    return model, path, hc.read_metadata(path), host_leaves(engine.cache)


def write(path: Path, text: str) -> None:
    (path / hc.METADATA_FILE).write_bytes(text.encode("utf-8", "surrogatepass"))


def check_read(path: Path, text: str):
    """read_metadata: the document as written, or EngineCheckpointError; within the deadline."""
    write(path, text)
    t = time.monotonic()
    try:
        got = hc.read_metadata(path)
    except hc.EngineCheckpointError:
        got = None
    assert time.monotonic() - t < READ_DEADLINE_S
    if got is not None:
        assert got == json.loads(text)
    return got


def check_restore(model, path: Path, want_leaves) -> None:
    """restore_engine: an engine with the saved cache and the document's settings, or
    EngineCheckpointError; within the deadline."""
    t = time.monotonic()
    try:
        engine = hkv.Engine.restore(path, model)
    except hc.EngineCheckpointError:
        engine = None
    assert time.monotonic() - t < RESTORE_DEADLINE_S
    if engine is not None:
        doc = hc.read_metadata(path)
        got = host_leaves(engine.cache)
        assert len(got) == len(want_leaves)
        assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(got, want_leaves, strict=True))
        e = doc["engine"]
        assert (engine.spec.block_tokens, engine.prefill_chunk, engine.spec.model_id, engine.cache_salt.hex()) == (
            e["block_tokens"],
            e["prefill_chunk"],
            e["model_id"],
            e["cache_salt"],
        )
        assert engine.retention == RetentionPolicy(**e["retention"])
        assert engine.spec.fingerprint() == doc["abi_fingerprint"]


def fuzz_copy(checkpoint, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("fuzzcopy") / "ckpt"
    shutil.copytree(checkpoint[1], dst)
    return dst


FAST = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def read_fuzz(checkpoint, tmp_path_factory, examples: int):
    path = fuzz_copy(checkpoint, tmp_path_factory)

    @settings(max_examples=examples, **FAST)
    @given(st.data())
    def run(data):
        _, text = data.draw(mutated_documents(checkpoint[2]))
        check_read(path, text)

    run()


def restore_fuzz(checkpoint, tmp_path_factory, examples: int):
    model, _, doc, want = checkpoint
    path = fuzz_copy(checkpoint, tmp_path_factory)

    @settings(max_examples=examples, **FAST)
    @given(st.data())
    def run(data):
        _, text = data.draw(mutated_documents(doc))
        check_read(path, text)
        check_restore(model, path, want)  # a document read_metadata refused costs nothing more here

    run()


def test_fuzzed_metadata_is_read_back_exactly_or_refused_by_name(checkpoint, tmp_path_factory):
    read_fuzz(checkpoint, tmp_path_factory, examples=60)


def test_fuzzed_metadata_restores_exactly_or_is_refused_by_name(checkpoint, tmp_path_factory):
    restore_fuzz(checkpoint, tmp_path_factory, examples=25)


def test_the_unmutated_document_round_trips(checkpoint, tmp_path_factory):
    """The fuzzer's own sealing is faithful: the base document, re-sealed, reads and restores."""
    model, _, doc, want = checkpoint
    path = fuzz_copy(checkpoint, tmp_path_factory)
    assert check_read(path, seal(doc)) == doc
    check_restore(model, path, want)
    assert hkv.Engine.restore(path, model) is not None


@pytest.mark.slow
def test_fuzzed_metadata_many(checkpoint, tmp_path_factory):
    read_fuzz(checkpoint, tmp_path_factory, examples=3000)
    restore_fuzz(checkpoint, tmp_path_factory, examples=300)
