"""hkv: the KV cache of hybrid-attention LLMs as one immutable pytree with pure transitions.

    spec      = CacheSpec(...)                       # what each layer keeps (models build it)
    layout    = CacheLayout(spec, CacheConfig(slots=4, max_context=8192))
    cache     = init_cache(layout)
    cache, slot, status = transitions.claim_slot(layout, cache)
    check_invariants(layout, cache)                  # declared state == actual state
    engine    = Engine(model, CacheConfig(...)); engine.generate(prompts, max_new_tokens=32)
    handle    = engine.submit(prompt, 64, sampling=SamplingParams(temperature=0.7, seed=0)); list(handle)
    cache, new, n, status = decode_loop(model, layout, cache, last, slots, steps=32)   # in your jax.jit

Packages (dependencies point one way: models -> hkv.engine -> hkv.core -> pallas_kernels, and
hkv.engine -> hkv.store): `hkv.core` is pure and jittable (spec, layout, the cache pytree,
transitions, prefix index, the model-facing layer API), `hkv.engine` runs on the host (the Engine,
prefix manager, offload, warm restart), `hkv.store` is the disk tier. See docs/design.md.
"""

from . import numerics
from .core import transitions
from .core.decode import DecodeOutput, decode_loop, decode_steps, step_and_sample
from .core.invariants import InvariantError, check_invariants
from .core.layers import InteriorSnapshots, LayerCache, Step, default_read_buckets, run_step
from .core.layout import CacheConfig, CacheLayout, Residency, Status
from .core.memory import allocated_bytes, architectural_minimum, memory_report, uniform_full_kv_bytes
from .core.plan import DevicePlan, RestorePlan
from .core.policy import RetentionPolicy
from .core.protocol import CachedModel
from .core.reasons import Reason
from .core.sampling import SamplingBatch, SamplingParams
from .core.spec import CacheSpec, CompressorSpec, Group, KVQuant, LayerSpec, ObjectKind
from .core.state import HybridCache, init_cache
from .core.weights import weights_digest
from .engine.checkpoint import EngineCheckpointError
from .engine.compiled import enable_compilation_cache
from .engine.engine import CacheCapacityError, Engine
from .engine.prefix_tools import PrefixQuery, evict_cached, record_prefix, restore_prefix
from .engine.requests import (
    EngineBusyError,
    EngineClosedError,
    Generation,
    RequestCancelledError,
    RequestHandle,
    TokenOutput,
)
from .engine.sharded import MeshEngine
from .store.host import HostTier
from .store.tier import DiskTier, DiskTierClosedError
from .store.tiered import TieredStore

__all__ = [
    "CacheCapacityError",
    "CacheConfig",
    "CacheLayout",
    "CacheSpec",
    "CachedModel",
    "CompressorSpec",
    "DecodeOutput",
    "DevicePlan",
    "DiskTier",
    "DiskTierClosedError",
    "Engine",
    "EngineBusyError",
    "EngineCheckpointError",
    "EngineClosedError",
    "Generation",
    "Group",
    "HostTier",
    "HybridCache",
    "InteriorSnapshots",
    "InvariantError",
    "KVQuant",
    "LayerCache",
    "LayerSpec",
    "MeshEngine",
    "ObjectKind",
    "PrefixQuery",
    "Reason",
    "RequestCancelledError",
    "RequestHandle",
    "Residency",
    "RestorePlan",
    "RetentionPolicy",
    "SamplingBatch",
    "SamplingParams",
    "Status",
    "Step",
    "TieredStore",
    "TokenOutput",
    "allocated_bytes",
    "architectural_minimum",
    "check_invariants",
    "decode_loop",
    "decode_steps",
    "default_read_buckets",
    "enable_compilation_cache",
    "evict_cached",
    "init_cache",
    "memory_report",
    "numerics",
    "record_prefix",
    "restore_prefix",
    "run_step",
    "step_and_sample",
    "transitions",
    "uniform_full_kv_bytes",
    "weights_digest",
]
