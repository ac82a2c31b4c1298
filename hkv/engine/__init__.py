"""hkv's host side: the `Engine` facade (admission, chunked prefill, decode, preemption), the prefix
manager (block keys, lookup, record, retention, eviction), offload to the disk tier and warm restart.

    engine.py       Engine, Generation, CacheCapacityError
    block_keys.py   chained block keys of token ids (host hashing)
    offload.py      device <-> host payloads for the disk tier (swap-out / swap-in transitions)
    checkpoint.py   warm restart: Engine.save / Engine.restore (orbax, verified before use)
"""
