"""The `hkv` command line: inspect a disk tier store (`hkv.store.tier.DiskTier`) without an engine.

    hkv store verify PATH         check every published manifest and every object's checksum
    hkv store stats PATH          size, segments, blocks, snapshots and restore hits per ABI fingerprint

PATH is a directory (the `file` kvstore; a directory holding an OCDBT database, i.e. a
`manifest.ocdbt` file, is opened through the `ocdbt` driver), a kvstore URL (`file:///...`,
`gs://bucket/prefix/`, ...), or, instead of PATH, `--spec JSON`: a full tensorstore kvstore spec.
Both commands only read the store (nothing is created, repaired or deleted) and accept `--json`.
A keyed store (`hkv.DiskTier(key=...)`) is checked with the key in the `HKV_STORE_KEY` environment
variable (hex); without it every manifest of a keyed store is reported as `disk_auth`.

Exit codes: 0 every published block is intact (data of interrupted writes, "orphaned segments",
and blocks a writer stopped before indexing, "unindexed blocks", are reported but are not a
failure); 1 any published block, manifest or hit file fails verification
(every problem is reported: verify never stops at the first); 2 a usage error or a store that
cannot be opened.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2
_STORE_DIRS = ("manifests", "data", "hits")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class _UsageError(Exception):
    """A bad argument or a store that cannot be opened (exit code 2)."""


def parse_size(text: str) -> int:
    """Bytes from '1048576', '512K', '10MiB', '2GB', '1.5T' (K/M/G/T are binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1073741824, 512M, 10GiB)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def _human(n: int | float) -> str:
    if n < 1024:
        return f"{n:,.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:,.1f} {unit}"


def _directory_spec(path: str) -> dict:
    """The kvstore spec of an existing local directory; `_UsageError` if it is not one."""
    if not os.path.exists(path):
        raise _UsageError(f"no such directory: {path} (a store is never created by this command)")
    if not os.path.isdir(path):
        raise _UsageError(f"not a directory: {path}")
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "manifest.ocdbt")):
        return {"driver": "ocdbt", "base": f"file://{path.rstrip('/')}/"}
    entries = os.listdir(path)
    if entries and not any(os.path.isdir(os.path.join(path, d)) for d in _STORE_DIRS):
        raise _UsageError(
            f"{path} does not look like an hkv disk tier store (no {'/, '.join(_STORE_DIRS)}/ and no manifest.ocdbt)"
        )
    return {"driver": "file", "path": path + "/"}


def store_spec(path: str | None, spec: str | None) -> dict | str:
    """What `DiskTier` opens for a PATH argument or a --spec JSON (see the module docstring)."""
    if (path is None) == (spec is None):
        raise _UsageError("give exactly one of PATH or --spec JSON")
    if spec is not None:
        try:
            doc = json.loads(spec)
        except json.JSONDecodeError as e:
            raise _UsageError(f"--spec is not JSON: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("driver"), str):
            raise _UsageError(
                '--spec must be a JSON object with a "driver", e.g. {"driver": "ocdbt", "base": "file:///data/hkv/"}'
            )
        return doc
    if "://" in path:
        if path.startswith("file://") and "|" not in path:
            return _directory_spec(path[len("file://") :])
        return path
    return _directory_spec(path)


def _describe(spec: dict | str) -> str:
    if isinstance(spec, str):
        return spec
    if spec.get("driver") == "file":
        return spec["path"].rstrip("/")
    if spec.get("driver") == "ocdbt" and isinstance(spec.get("base"), str):
        return f"{spec['base']} (ocdbt)"
    return json.dumps(spec, sort_keys=True)


def _temp_only_segments(spec: dict | str, listed: list[str]) -> list[str]:
    """Problem lines for segment directories of a `file` store that hold only the driver's temporary
    files (`*.__lock`) of a write killed before any key was committed: invisible to kvstore listing,
    so `DiskTier.verify` cannot see them. An empty folder (no file anywhere under it) is nothing:
    no data was ever written there, or it was deleted."""
    if not (isinstance(spec, dict) and spec.get("driver") == "file"):
        return []
    root, out = spec["path"], []
    for seg_dir in sorted(glob.glob(os.path.join(glob.escape(root), "data", "*", "*", ""))):
        abi, seg = seg_dir.rstrip("/").split("/")[-2:]
        name = f"data/{abi}/{seg}/"
        if any(line.startswith(name) for line in listed):
            continue
        if not any(files for _, _, files in os.walk(seg_dir)):
            continue
        if not os.path.lexists(os.path.join(root, "manifests", abi, f"{seg}.json")):
            out.append(f"{name}: only temporary files of an interrupted write (ignored)")
    return out


def _open(spec: dict | str):
    from .tier import DiskTier

    try:
        return DiskTier(spec)
    except Exception as e:  # any failure to open is "cannot open", exit 2
        raise _UsageError(str(e)) from None


def _close(tier) -> None:
    # neither verify nor stats counts a hit, so closing writes nothing to the store
    tier.close()


# ------------------------------------------------------------------------------------ verify
def cmd_verify(args) -> int:
    from .tier import DISK_REASONS

    spec = store_spec(args.path, args.spec)
    tier = _open(spec)
    try:
        report = tier.verify()
    finally:
        _close(tier)
    bad = sum(report[r] for r in DISK_REASONS)
    orphans = [p for p in report["problems"] if p.startswith("data/")]
    orphans += _temp_only_segments(spec, orphans)
    report["orphaned_segments"] = len(orphans)
    problems = [p for p in report["problems"] if not p.startswith("data/")]
    code = EXIT_BAD if bad else EXIT_OK
    if args.json:
        out = {
            "store": _describe(spec),
            "ok": not bad,
            "exit_code": code,
            "segments": report["segments"],
            "blocks_ok": report["blocks_ok"],
            **{r: report[r] for r in DISK_REASONS},
            "orphaned_segments": report["orphaned_segments"],
            "unindexed_blocks": report["unindexed_blocks"],
            "problems": problems,
            "unindexed": report["unindexed"],
            "orphans": orphans,
        }
        print(json.dumps(out, indent=2))
        return code
    print(f"hkv disk tier: {_describe(spec)}")
    print(f"published segments   {report['segments']}")
    print(f"blocks ok            {report['blocks_ok']}")
    for r in DISK_REASONS:
        print(f"{r:<20} {report[r]}")
    print(
        f"orphaned segments    {report['orphaned_segments']}"
        + (
            "  (data without a manifest, left by interrupted writes: never read; not a failure)"
            if report["orphaned_segments"]
            else ""
        )
    )
    print(
        f"unindexed blocks     {report['unindexed_blocks']}"
        + (
            "  (published and intact, but no lookup reaches them: a writer stopped between its manifest"
            " and its pointers; not a failure)"
            if report["unindexed_blocks"]
            else ""
        )
    )
    if problems:
        print("problems:")
        for p in problems:
            print(f"  {p}")
    if report["unindexed"]:
        print("unindexed blocks (intact, not a failure):")
        for p in report["unindexed"]:
            print(f"  {p}")
    if orphans:
        print("orphaned data:")
        for p in orphans:
            print(f"  {p}")
    if bad:
        print(
            f"FAILED: {bad} published block(s), manifest(s) or hit file(s) fail verification "
            f"(a restore of them is refused with the reason above, never used)"
        )
    else:
        note = (
            f"; {report['orphaned_segments']} orphaned segment(s) from interrupted writes are not a failure"
            if report["orphaned_segments"]
            else ""
        )
        print(f"OK: every published block is intact{note}")
    return code


# ------------------------------------------------------------------------------------- stats
def cmd_stats(args) -> int:
    spec = store_spec(args.path, args.spec)
    # the budget is only compared against: a tier opened with it would also refuse larger segments
    tier = _open(spec)
    try:
        st = tier.stats()
    finally:
        _close(tier)
    abis = {
        abi: {k: d[k] for k in ("segments", "blocks", "snapshots", "stored_bytes", "hits")}
        for abi, d in sorted(st["abis"].items())
    }
    total = {k: sum(d[k] for d in abis.values()) for k in ("blocks", "snapshots", "hits")}
    budget = args.budget
    if args.json:
        out = {
            "store": _describe(spec),
            "segments": st["segments"],
            "stored_bytes": st["stored_bytes"],
            **total,
            "bad_files": st["bad_files"],
            "budget_bytes": budget,
            "budget_used": (st["stored_bytes"] / budget if budget else None),
            "abis": abis,
        }
        print(json.dumps(out, indent=2))
        return EXIT_OK
    print(f"hkv disk tier: {_describe(spec)}")
    print(f"size       {_human(st['stored_bytes'])} ({st['stored_bytes']:,} bytes of segment data)")
    print(f"segments   {st['segments']}")
    print(f"blocks     {total['blocks']} ({total['snapshots']} with a snapshot)")
    print(f"hits       {total['hits']} (restores saved by every writer)")
    if st["bad_files"]:
        print(
            "bad files  "
            + ", ".join(f"{n} {r}" for r, n in sorted(st["bad_files"].items()))
            + " (skipped: run `hkv store verify` for details)"
        )
    if budget is None:
        print("budget     none given (a store records no budget; pass --budget BYTES to compare)")
    else:
        pct = f"{100 * st['stored_bytes'] / budget:.1f}% used" if budget else "0-byte budget"
        print(f"budget     {_human(budget)} ({budget:,} bytes), {pct}")
    if abis:
        print(f"{'ABI fingerprint':<34} {'segments':>8} {'blocks':>8} {'snapshots':>9} {'stored':>12} {'hits':>8}")
        for abi, d in abis.items():
            print(
                f"{abi:<34} {d['segments']:>8} {d['blocks']:>8} {d['snapshots']:>9} "
                f"{_human(d['stored_bytes']):>12} {d['hits']:>8}"
            )
    return EXIT_OK


# ------------------------------------------------------------------------------------ parser
def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="store directory (an OCDBT database in it is detected), or a kvstore URL",
    )
    p.add_argument(
        "--spec",
        metavar="JSON",
        help='a tensorstore kvstore spec instead of PATH, e.g. \'{"driver": "ocdbt", "base": "file:///data/hkv/"}\'',
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hkv",
        description="hkv: KV cache for hybrid-attention LLMs. Tools for the on-disk prefix tier.",
        epilog="exit codes: 0 ok, 1 verification failed, 2 usage error or unopenable store",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    store = sub.add_parser(
        "store",
        help="inspect a disk tier store (verify, stats)",
        description="Inspect a disk tier store (hkv.store.tier.DiskTier). Read-only: nothing is created or repaired.",
        epilog="PATH: a directory (file kvstore; a directory with manifest.ocdbt opens as OCDBT), a kvstore URL "
        "(file:///..., gs://..., s3://...), or --spec JSON instead. Exit codes: 0 ok, 1 verification "
        "failed, 2 usage error or unopenable store.",
    )
    ssub = store.add_subparsers(dest="store_command", metavar="SUBCOMMAND")
    v = ssub.add_parser(
        "verify",
        help="check every manifest and every object's checksum",
        description="Read every published block back and check it (manifest schema and checksum, ABI, crc32c of "
        "the data chunks, per-object sum64 (crc32 in older manifests); with HKV_STORE_KEY set, each "
        "manifest's HMAC). Reports "
        "blocks ok, disk_checksum, disk_missing, disk_truncated, disk_abi, disk_auth, disk_malformed "
        "(manifests and hit files), and orphaned segments (data of interrupted writes, never read).",
        epilog="exit codes: 0 every published block intact (orphaned data alone is not a failure), "
        "1 any block, manifest or hit file fails (every one is reported), 2 usage error or unopenable store",
    )
    _add_store_args(v)
    v.set_defaults(func=cmd_verify)
    s = ssub.add_parser(
        "stats",
        help="size, segments, blocks, snapshots, hits per ABI fingerprint",
        description="Size, segments, blocks, snapshots and restore hit counts (saved by every writer) per ABI "
        "fingerprint, and the budget.",
    )
    _add_store_args(s)
    s.add_argument(
        "--budget",
        type=parse_size,
        metavar="BYTES",
        help="the budget the engines use (e.g. 64GiB) to report usage against; the store records none",
    )
    s.set_defaults(func=cmd_stats)
    parser._hkv_store = store  # for `hkv store` without a subcommand
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `hkv` command line; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or an argparse usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "store" and args.store_command is None:
        parser._hkv_store.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except _UsageError as e:
        print(f"hkv: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # an I/O failure while reading the store: report, don't trace
        print(f"hkv: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
