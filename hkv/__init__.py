"""hkv: the KV cache of hybrid-attention LLMs as one immutable pytree with pure transitions.

spec      = CacheSpec(...)                       # what each layer keeps (models build it)
layout    = CacheLayout(spec, CacheConfig(slots=4, max_context=8192))
cache     = init_cache(layout)
cache, slot, status = transitions.claim_slot(layout, cache)
check_invariants(layout, cache)                  # declared state == actual state
engine    = Engine(model, CacheConfig(...)); engine.generate(prompts, max_new_tokens=32)
"""

from .checkpoint import EngineCheckpointError
from .disk import DiskTier, DiskTierClosedError
from .engine import CacheCapacityError, Engine, Generation
from .invariants import InvariantError, check_invariants
from .memory import architectural_minimum, memory_report, uniform_full_kv_bytes
from .plan import RestorePlan
from .policy import RetentionPolicy
from .spec import CacheSpec, CompressorSpec, Group, LayerSpec, ObjectKind
from .state import CacheConfig, CacheLayout, HybridCache, Residency, Status, init_cache
from .weights import weights_digest

__all__ = [
    "CacheCapacityError",
    "DiskTier",
    "DiskTierClosedError",
    "EngineCheckpointError",
    "Engine",
    "Generation",
    "architectural_minimum",
    "memory_report",
    "uniform_full_kv_bytes",
    "RestorePlan",
    "RetentionPolicy",
    "CacheConfig",
    "CacheLayout",
    "CacheSpec",
    "CompressorSpec",
    "Group",
    "HybridCache",
    "InvariantError",
    "LayerSpec",
    "ObjectKind",
    "Residency",
    "Status",
    "check_invariants",
    "init_cache",
    "weights_digest",
]
