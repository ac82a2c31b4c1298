"""hkv's prefix tiers below device memory (host memory, disk through tensorstore): never imports the engine.

tier.py      DiskTier: segments, group commit, verified reads, budget, keyed stores (composed of the parts below)
context.py   TierContext: the state every part shares (kvstore, key, lock, counters); bounded small-file reads
blocks.py    the values the parts pass and DiskTier returns (BlockPayload, BlockRef, ChainLookup, ReadResult, Segment)
index.py     SegmentIndex: bounded caches of block pointers and manifests, chain lookups by GET (no listing)
records.py   block pointers (blocks/<id>.json) and fixed-size records updated by compare-and-swap
coord.py     the usage ledger, the eviction lease and each writer's hot segments (budget/)
listing.py   paged listings of the store (verify, stats, the evictor)
read.py      BlockReader: concurrent reads, verified before anything is returned
write.py     SegmentWriter: the writer and publisher threads (group commit, pipelined shard writes)
layout.py    Layout: a segment's bytes as a sharded zarr3 array
budget.py    Budget: eviction of whole segments over budget_bytes (one evictor at a time, one-pass ranking)
hits.py      HitCounts: restore counts per block, per writer
verify.py    verify_store and store_stats (DiskTier.verify / stats)
manifest.py  the manifest format: bounded parsing, checksums, HMAC
cli.py       `hkv store ...`: ls, verify, gc
host.py      HostTier: blocks in host memory (bounded bytes, digests checked at every read, LRU leaves evicted)
tiered.py    TieredStore: a HostTier over a DiskTier (spill to disk, promotion on hit, prefetch of a chain)
"""
