"""hkv's disk tier (tensorstore): never imports the engine.

tier.py      DiskTier: segments, group commit, verified reads, budget, keyed stores
manifest.py  the manifest format: bounded parsing, checksums, HMAC
cli.py       `hkv store ...`: ls, verify, gc
"""
