"""How a segment's bytes lie in the store: a zarr3 uint8 array under `data/<abi>/<segment>/`, shards
(files `c/<i>`) of `shard_bytes` made of `chunk_bytes` inner chunks, crc32c in the chunk and the
shard-index codecs (`Layout`, `array_spec`, `open_array`). Its zarr.json is never stored: a checked
manifest's data_bytes / chunk_bytes / shard_bytes determine it.
"""

from __future__ import annotations

import dataclasses

import tensorstore as ts


def array_spec(kv: ts.KvStore, n: int, chunk: int, shard: int) -> dict:
    """The zarr3 spec of a segment's data: `n` bytes (uint8), shards of `shard` bytes made of inner
    chunks of `chunk` bytes, crc32c in the chunk and the shard-index codecs.

    Args:
        kv: the kvstore of the segment's data folder (`data/<abi>/<segment>/`).
        n: the array's bytes (whole chunks: `Layout.padded`).
        chunk: inner chunk bytes.
        shard: shard bytes.
    Returns:
        The tensorstore spec (JSON).
    """
    return {
        "driver": "zarr3",
        "kvstore": kv.spec().to_json(),
        "store_data_equal_to_fill_value": True,
        "fill_missing_data_reads": False,  # a missing shard is an error (disk_missing), never zeros
        "metadata": {
            "shape": [n],
            "data_type": "uint8",
            "fill_value": 0,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [shard]}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [chunk],
                        "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                        "index_location": "end",
                    },
                }
            ],
        },
    }


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a segment's `data_bytes` live: inner `chunk`, the array's `padded` bytes (whole chunks),
    shards of `shard` bytes (the last may be shorter), one file each (`c/<i>`, `files[i]` bytes)."""

    chunk: int
    padded: int
    shard: int

    @property
    def count(self) -> int:
        """Number of shards (bounded by `hkv.disk_manifest.MAX_SHARDS` for a checked manifest)."""
        return -(-self.padded // self.shard)

    def shard_range(self, i: int) -> tuple[int, int]:
        """[lo, hi) byte range of shard i."""
        return i * self.shard, min((i + 1) * self.shard, self.padded)

    def file_bytes(self, i: int) -> int:
        """Bytes of shard i's file: its chunks with their crc32c, and an index over every chunk
        position of a whole shard (16 bytes each) with its crc32c."""
        lo, hi = self.shard_range(i)
        return (hi - lo) // self.chunk * (self.chunk + 4) + self.shard // self.chunk * 16 + 4

    @property
    def shards(self) -> list[tuple[int, int]]:
        """[lo, hi) byte range of every shard."""
        return [self.shard_range(i) for i in range(self.count)]

    @property
    def files(self) -> list[int]:
        """Bytes of each shard file (see `file_bytes`)."""
        return [self.file_bytes(i) for i in range(self.count)]

    @classmethod
    def plan(cls, data_bytes: int, chunk_bytes: int, shard_bytes: int) -> Layout:
        """The layout a writer picks: a segment smaller than `chunk_bytes` is one chunk rounded up to
        4 KiB (padding stays under 4 KiB); one larger than `shard_bytes` is cut into shards."""
        chunk = min(chunk_bytes, -(-max(data_bytes, 1) // 4096) * 4096)
        padded = -(-max(data_bytes, 1) // chunk) * chunk
        return cls(chunk, padded, min(shard_bytes, padded))

    @classmethod
    def of(cls, doc: dict) -> Layout:
        """The layout a checked manifest recorded (version 1, no `shard_bytes`: one shard)."""
        chunk = doc["chunk_bytes"]
        padded = -(-max(doc["data_bytes"], 1) // chunk) * chunk
        return cls(chunk, padded, doc.get("shard_bytes") or padded)


def data_prefix(abi: str, segment: str) -> str:
    """The folder (key prefix) of a segment's data array.

    Args:
        abi: the ABI fingerprint.
        segment: the segment name.
    Returns:
        `data/<abi>/<segment>/`.
    """
    return f"data/{abi}/{segment}/"


def open_array(kv: ts.KvStore, abi: str, segment: str, lay: Layout, context: ts.Context) -> ts.Future:
    """Open a segment's data array with the metadata its layout determines (nothing is read).

    Args:
        kv: the store.
        abi: the ABI fingerprint.
        segment: the segment name.
        lay: the segment's layout.
        context: the tensorstore context.
    Returns:
        The future of the opened `ts.TensorStore`.
    """
    return ts.open(
        array_spec(kv / data_prefix(abi, segment), lay.padded, lay.chunk, lay.shard),
        open=True,
        assume_metadata=True,
        context=context,
    )
