"""`Engine.warmup()` promises that "the first request pays only its own work": a first prefix record
and restore after it compile nothing. They used to build small eager programs on the request's path:
`jnp.asarray` of host arrays (in this jax, an identity program per new shape and dtype, logged as
`jit(stage)`: `prefix_tools.pack_records`, the eviction masks, `_rebuild_window`'s padded ids),
`prefix_manager._could_match` (a module-level `jax.jit`, now compiled by `PrefixManager.warm`), eager
indexing of a device array (`jit(dynamic_slice)`, `jit(squeeze)`). Found by benchmarks/serving.py,
which lists what compiles while it times."""

from __future__ import annotations

import logging
import re

import jax
import pytest

import hkv
from models import toy

CONF = hkv.CacheConfig(slots=2, max_context=96, page_size=16, prefix_records=16)
COMPILING = re.compile(r"^Compiling (\S+)")


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record) -> None:
        m = COMPILING.match(record.getMessage())
        if m:
            self.names.append(m.group(1))


@pytest.fixture
def compiles():
    handler, logger = _Compiles(), logging.getLogger("jax")
    saved = jax.config.jax_log_compiles, logger.propagate
    jax.config.update("jax_log_compiles", True)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        jax.config.update("jax_log_compiles", saved[0])
        logger.propagate = saved[1]


def test_after_warmup_a_first_prefix_restore_compiles_nothing(compiles):
    engine = hkv.Engine(toy.init(toy.ToyConfig(), seed=3), CONF)
    engine.warmup()
    before = len(compiles.names)
    first = list(range(3, 43))  # 40 tokens: two full blocks recorded
    engine.generate([first], 4)
    (g,) = engine.generate([[*first, 7, 8, 9]], 4)
    assert g.plan.restored_tokens == 32  # the two blocks, restored
    assert compiles.names[before:] == [], f"compiled on requests' paths after warmup(): {compiles.names[before:]}"
