"""hkv's pure, jittable core: imports only jax, flax, numpy and `pallas_kernels`.

spec.py          CacheSpec / LayerSpec / CompressorSpec: what each layer keeps (model-agnostic)
kv_quant.py      FP8 rows (KVQuant): pack / unpack / round, dequantized page views for decode
layout.py        CacheConfig, CacheLayout (static shapes), Status, Residency, pytree node types
state.py         HybridCache (the one pytree), init_cache, check_layout, counters
transitions.py   pure transitions: claim/release slot, reserve, typed writes, advance, slide
prefix_index.py  PrefixIndex: records and TAIL snapshots inside the cache
prefix.py        record / restore (four validation stages + claim, one transition) / evict
plan.py          DevicePlan (restore's typed result) and RestorePlan (its host form)
reasons.py       Reason: the one vocabulary of rejections (device, disk tier, metrics)
layers.py        the model-facing API: per-layer views and attention ops (any Flax model)
protocol.py      CachedModel: the methods an engine calls on a model
invariants.py    check_invariants: declared state == actual state
policy.py        retention and eviction policies, receptive field, window-rebuild route
memory.py        memory_report / architectural_minimum
weights.py       weights_digest: the identity of a model's weights (ABI fingerprint)
"""
