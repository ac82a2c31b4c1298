"""`EngineHooks`: what an engine's parts (compile plan, prefix manager, scheduler) use of the engine
that owns them — callables, so that an engine whose cache lives elsewhere (a data shard of a mesh)
serves the same parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["EngineHooks", "Forward"]


@dataclasses.dataclass(frozen=True)
class EngineHooks:
    """Attributes:
    tx: `tx(fn, *args) -> outputs`: run the donating transition `fn(layout, cache, *args)` on the
      engine's cache and install its result at once (`Engine._tx`).
    view: the engine's cache for host reads (the prefix index, counters, page bookkeeping).
    cache: the cache value itself (to lower a step built ahead).
    weights: the model weights as the steps take them.
    say: a one-line progress message.
    live: the requests holding a slot, oldest admission first.
    while_building: the engine's `decode_while_building`.
    vocab_size: the model's vocabulary.
    """

    tx: Callable[..., tuple]
    view: Callable[[], Any]
    cache: Callable[[], Any]
    weights: Callable[[], Any]
    say: Callable[[str], None]
    live: Callable[[], list]
    while_building: Callable[[], bool]
    vocab_size: int


class Forward:
    """An engine attribute held by one of its parts: `name = Forward("prefix_manager", "disk", doc)`
    reads (and, unless `read_only`, assigns) `engine.prefix_manager.disk`.

    Args:
      part: the engine attribute holding the part. name: the part's attribute.
      doc: the attribute's docstring. read_only: refuse assignment (`AttributeError`).
    """

    def __init__(self, part: str, name: str, doc: str, *, read_only: bool = False):
        self.part, self.name, self.__doc__, self.read_only = part, name, doc, read_only

    def __set_name__(self, owner, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value) -> None:
        if self.read_only:
            raise AttributeError(f"{type(obj).__name__}.{self.attr} is read-only")
        setattr(getattr(obj, self.part), self.name, value)
