"""`hkv store verify|stats` (hkv.store.cli) on small synthetic disk tier stores: the exit codes, the per-reason
counts for each kind of damage, the JSON output, path handling (missing directory, OCDBT detection)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from hkv.store.cli import main, parse_size
from hkv.store.tier import BlockPayload, DiskTier

ABI = "ab" * 16
ABI2 = "cd" * 16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BT = 4  # block tokens


def _key(chain: str, i: int) -> bytes:
    return hashlib.blake2b(f"{chain}-{i}".encode(), digest_size=16).digest()


def _chain(chain: str, n: int, seed: int) -> list[BlockPayload]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        objects = {
            "g0.rows": (rng.standard_normal((2, 8)).astype(np.float32), 2 * i),
            "g1.rows": (rng.standard_normal((1, 16)).astype(ml_dtypes.bfloat16), i),
        }
        if i == n - 1:
            objects["g2.window"] = (rng.standard_normal((4, 8)).astype(ml_dtypes.bfloat16), i * BT)
        out.append(
            BlockPayload(
                key=_key(chain, i),
                parent=_key(chain, i - 1) if i else None,
                index=i,
                length=(i + 1) * BT,
                tokens=[seed, i, 7, 9],
                indexer_version=1,
                snapshot=i == n - 1,
                objects=objects,
            )
        )
    return out


def _segment_of(path, abi: str, chain: str) -> str:
    """The name of the segment holding `chain` (from its manifest)."""
    for name in os.listdir(os.path.join(path, "manifests", abi)):
        doc = json.loads(pathlib.Path(path, "manifests", abi, name).read_bytes())
        if doc["blocks"][0]["key"] == _key(chain, 0).hex():
            return doc["segment"]
    raise AssertionError(chain)


@pytest.fixture
def store(tmp_path):
    """3 segments, 7 blocks (3 snapshots): chains a (3 blocks) and b (2) under ABI, c (2) under ABI2."""
    path = tmp_path / "store"
    tier = DiskTier(str(path))
    tier.write(ABI, _chain("a", 3, 1))
    tier.write(ABI, _chain("b", 2, 2))
    tier.write(ABI2, _chain("c", 2, 3))
    tier.close()
    return path


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _count(out: str, label: str) -> int:
    m = re.search(rf"^{re.escape(label)}\s+(\d+)", out, re.M)
    assert m, f"{label!r} not in:\n{out}"
    return int(m.group(1))


def _data_file(path, abi, chain) -> str:
    return os.path.join(path, "data", abi, _segment_of(path, abi, chain), "c", "0")


def test_verify_clean(store, capsys):
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 0
    assert _count(out, "blocks ok") == 7 and _count(out, "published segments") == 3
    for r in (
        "disk_checksum",
        "disk_missing",
        "disk_truncated",
        "disk_abi",
        "disk_auth",
        "disk_malformed",
        "orphaned segments",
    ):
        assert _count(out, r) == 0
    assert "OK: every published block is intact" in out


def test_verify_flipped_byte_is_disk_checksum(store, capsys):
    f = _data_file(store, ABI, "a")
    raw = bytearray(pathlib.Path(f).read_bytes())
    raw[10] ^= 0x40
    pathlib.Path(f).write_bytes(bytes(raw))
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 1
    assert _count(out, "disk_checksum") == 3 and _count(out, "blocks ok") == 4
    assert "disk_checksum" in out.split("problems:")[1] and "FAILED" in out


def test_verify_truncated_data_is_disk_truncated(store, capsys):
    f = _data_file(store, ABI, "b")
    raw = pathlib.Path(f).read_bytes()
    pathlib.Path(f).write_bytes(raw[: len(raw) // 3])
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 1
    assert _count(out, "disk_truncated") == 2 and _count(out, "blocks ok") == 5
    assert _count(out, "disk_checksum") == 0


def test_verify_deleted_data_is_disk_missing(store, capsys):
    shutil.rmtree(os.path.dirname(_data_file(store, ABI2, "c")))
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 1
    assert _count(out, "disk_missing") == 2 and _count(out, "blocks ok") == 5


def test_deleted_manifest_leaves_orphaned_data_not_a_failure(store, capsys):
    seg = _segment_of(store, ABI, "a")
    os.remove(os.path.join(store, "manifests", ABI, f"{seg}.json"))
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 0  # no published block is bad: the segment simply does not exist any more
    assert _count(out, "orphaned segments") == 1 and _count(out, "blocks ok") == 4
    assert f"data/{ABI}/{seg}/" in out and "interrupted" in out and "not a failure" in out
    assert "OK: every published block is intact" in out


def test_write_killed_before_any_commit_is_an_orphan(store, capsys):
    # the file driver writes <key>.__lock then renames it: a write killed before the rename leaves
    # only that temporary file, which kvstore listing (and so DiskTier.verify) does not show
    seg_dir = os.path.join(store, "data", ABI, "20990101T000000-deadbeef0000-00000000")
    os.makedirs(os.path.join(seg_dir, "c"))
    pathlib.Path(seg_dir, "c", "0.__lock").write_bytes(b"\0" * 100)
    code, out, _ = _run(capsys, "store", "verify", "--json", store)
    rep = json.loads(out)
    assert code == 0 and rep["ok"] and rep["blocks_ok"] == 7 and rep["orphaned_segments"] == 1
    assert rep["orphans"] == [
        f"data/{ABI}/20990101T000000-deadbeef0000-00000000/: only temporary files of an interrupted write (ignored)"
    ]


def test_corrupt_manifest_json_is_disk_checksum(store, capsys):
    seg = _segment_of(store, ABI, "b")
    m = os.path.join(store, "manifests", ABI, f"{seg}.json")
    raw = pathlib.Path(m).read_bytes()
    pathlib.Path(m).write_bytes(raw[:-7])
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 1
    assert _count(out, "disk_checksum") == 1 and _count(out, "blocks ok") == 5
    assert _count(out, "orphaned segments") == 0  # its data is the rejected manifest's, not an orphan
    assert f"manifests/{ABI}/{seg}.json: disk_checksum: not JSON" in out
    # an edited (valid JSON) manifest fails its own checksum
    doc = json.loads(raw)
    doc["blocks"][0]["tokens"][0] += 1
    pathlib.Path(m).write_bytes(json.dumps(doc).encode())
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 1 and _count(out, "disk_checksum") == 1 and "checksum does not match" in out


def test_manifest_under_another_abi_is_disk_abi(store, capsys):
    seg = _segment_of(store, ABI, "b")
    os.makedirs(os.path.join(store, "manifests", "ee" * 16))
    shutil.copy(
        os.path.join(store, "manifests", ABI, f"{seg}.json"), os.path.join(store, "manifests", "ee" * 16, f"{seg}.json")
    )
    code, out, _ = _run(capsys, "store", "verify", store)
    assert code == 1 and _count(out, "disk_abi") == 1 and _count(out, "blocks ok") == 7


def test_verify_json(store, capsys):
    code, out, _ = _run(capsys, "store", "verify", "--json", store)
    rep = json.loads(out)
    assert code == 0 and rep["ok"] is True and rep["exit_code"] == 0
    assert rep["blocks_ok"] == 7 and rep["segments"] == 3 and rep["problems"] == [] and rep["orphans"] == []
    f = _data_file(store, ABI, "a")
    raw = bytearray(pathlib.Path(f).read_bytes())
    raw[20] ^= 1
    pathlib.Path(f).write_bytes(bytes(raw))
    os.remove(os.path.join(store, "manifests", ABI2, f"{_segment_of(store, ABI2, 'c')}.json"))
    code, out, _ = _run(capsys, "store", "verify", store, "--json")
    rep = json.loads(out)
    assert code == 1 and rep["ok"] is False and rep["exit_code"] == 1
    assert rep["disk_checksum"] == 3 and rep["blocks_ok"] == 2 and rep["orphaned_segments"] == 1
    assert len(rep["problems"]) == 3 and all("disk_checksum" in p for p in rep["problems"])
    assert len(rep["orphans"]) == 1 and rep["orphans"][0].startswith(f"data/{ABI2}/")


def test_stats(store, capsys):
    tier = DiskTier(str(store))
    keys = [_key("a", i) for i in range(3)]
    found = tier.find_chain(ABI, keys, [[1, i, 7, 9] for i in range(3)])
    assert found.stop is None
    res = tier.read(found.refs[:2])
    assert res.reason is None and len(res.payloads) == 2
    tier.flush()  # persists the hit counts
    tier.close()
    code, out, _ = _run(capsys, "store", "stats", store)
    assert code == 0
    assert re.search(r"^segments\s+3$", out, re.M) and re.search(r"^blocks\s+7 \(3 with a snapshot\)", out, re.M)
    assert re.search(r"^hits\s+2\b", out, re.M) and "budget     none given" in out
    stored = DiskTier(str(store)).stats()["stored_bytes"]
    assert f"{stored:,} bytes" in out
    assert re.search(rf"^{ABI}\s+2\s+5\s+2\s+.*\s2$", out, re.M), out
    assert re.search(rf"^{ABI2}\s+1\s+2\s+1\s+.*\s0$", out, re.M), out

    code, out, _ = _run(capsys, "store", "stats", "--json", "--budget", "1MiB", store)
    st = json.loads(out)
    assert code == 0
    assert (st["segments"], st["blocks"], st["snapshots"], st["hits"]) == (3, 7, 3, 2)
    assert st["stored_bytes"] == stored and st["budget_bytes"] == 1 << 20
    assert st["budget_used"] == pytest.approx(stored / (1 << 20))
    assert st["abis"][ABI] == {
        "segments": 2,
        "blocks": 5,
        "snapshots": 2,
        "stored_bytes": st["abis"][ABI]["stored_bytes"],
        "hits": 2,
    }
    assert st["abis"][ABI2]["blocks"] == 2 and st["abis"][ABI2]["hits"] == 0
    code, out, _ = _run(capsys, "store", "stats", "--budget", "64K", store)
    assert code == 0 and "65,536 bytes" in out and "% used" in out


def test_cli_writes_nothing(store, capsys):
    before = sorted((d, sorted(f)) for d, _, f in os.walk(store))
    assert _run(capsys, "store", "verify", store)[0] == 0
    assert _run(capsys, "store", "stats", store)[0] == 0
    assert sorted((d, sorted(f)) for d, _, f in os.walk(store)) == before


def test_usage_errors_exit_2(tmp_path, store, capsys):
    missing = tmp_path / "nope"
    code, out, err = _run(capsys, "store", "verify", missing)
    assert code == 2 and "no such directory" in err and out == ""
    assert not missing.exists()  # never created
    assert _run(capsys, "store", "stats", missing)[0] == 2 and not missing.exists()
    assert _run(capsys, "store", "verify", f"file://{missing}")[0] == 2 and not missing.exists()
    afile = tmp_path / "f.txt"
    afile.write_text("x")
    assert _run(capsys, "store", "verify", afile)[0] == 2
    notastore = tmp_path / "other"
    notastore.mkdir()
    (notastore / "readme").write_text("x")
    code, _, err = _run(capsys, "store", "verify", notastore)
    assert code == 2 and "does not look like" in err
    assert _run(capsys, "store", "verify")[0] == 2  # neither PATH nor --spec
    assert _run(capsys, "store", "verify", store, "--spec", '{"driver": "memory"}')[0] == 2  # both
    code, _, err = _run(capsys, "store", "verify", "--spec", "{nope")
    assert code == 2 and "not JSON" in err
    assert _run(capsys, "store", "verify", "--spec", '["file"]')[0] == 2
    code, _, err = _run(capsys, "store", "verify", "--spec", '{"driver": "no-such-driver"}')
    assert code == 2 and "cannot open" in err
    assert _run(capsys, "store", "frobnicate", store)[0] == 2
    assert _run(capsys, "store", "stats", "--budget", "lots", store)[0] == 2
    assert _run(capsys)[0] == 2 and _run(capsys, "store")[0] == 2
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is an empty store
    code, out, _ = _run(capsys, "store", "verify", empty)
    assert code == 0 and _count(out, "blocks ok") == 0


def test_help(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "store" in out and "exit codes" in out
    code, out, _ = _run(capsys, "store", "--help")
    assert code == 0 and "verify" in out and "stats" in out and "ocdbt" in out.lower()
    code, out, _ = _run(capsys, "store", "verify", "--help")
    assert code == 0 and "--json" in out and "--spec" in out and "orphaned" in out
    code, out, _ = _run(capsys, "store", "stats", "--help")
    assert code == 0 and "--budget" in out


def test_parse_size():
    assert parse_size("1048576") == 1 << 20
    assert parse_size("512K") == 512 << 10 and parse_size("10MiB") == 10 << 20 and parse_size("2gb") == 2 << 30
    assert parse_size("1.5T") == 3 << 39


def test_ocdbt_store_detected_by_path(tmp_path, capsys):
    path = tmp_path / "ocdbt"
    tier = DiskTier({"driver": "ocdbt", "base": f"file://{path}/"})
    tier.write(ABI, _chain("a", 3, 1))
    tier.write(ABI2, _chain("c", 2, 3))
    tier.close()
    assert (path / "manifest.ocdbt").is_file() and not (path / "manifests").exists()
    code, out, _ = _run(capsys, "store", "verify", path)
    assert code == 0 and _count(out, "blocks ok") == 5 and "(ocdbt)" in out
    assert _run(capsys, "store", "verify", f"file://{path}")[0] == 0
    code, out, _ = _run(capsys, "store", "stats", "--json", path)
    assert code == 0 and json.loads(out)["blocks"] == 5
    code, out, _ = _run(
        capsys, "store", "verify", "--json", "--spec", json.dumps({"driver": "ocdbt", "base": f"file://{path}/"})
    )
    assert code == 0 and json.loads(out)["blocks_ok"] == 5
    # the same directory read as a plain file store shows no blocks: detection matters
    code, out, _ = _run(capsys, "store", "verify", "--spec", json.dumps({"driver": "file", "path": f"{path}/"}))
    assert code == 0 and _count(out, "blocks ok") == 0


def test_url_store(capsys):
    code, out, _ = _run(capsys, "store", "stats", "--json", "memory://")
    assert code == 0 and json.loads(out)["segments"] == 0


def test_python_m_hkv_cli(store):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.run(
        [sys.executable, "-m", "hkv", "store", "verify", "--json", str(store)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["blocks_ok"] == 7
    p = subprocess.run(
        [sys.executable, "-m", "hkv", "store", "stats", str(store) + "-missing"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "no such directory" in p.stderr
