"""`EngineOptions`: an engine's scheduling and compile settings, checked in the user's terms before
anything is allocated, and the checks of a cache layout against the device (`check_fits`)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from ..core.layers import default_read_buckets
from ..core.layout import CacheConfig, CacheLayout
from ..core.memory import allocated_bytes
from ..core.protocol import accepts_keyword
from ..store.host import HostTier
from ..store.tier import DiskTier
from ..store.tiered import TieredStore
from .chat import ChatTemplate
from .text import TextCodec

__all__ = [
    "RESTORE_CHOICES",
    "EngineOptions",
    "accepts_read_tokens",
    "accepts_snapshots",
    "check_fits",
    "device_bytes",
    "text_codec",
]


def _positive(name: str, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    return int(v)


def _ints_in(values, lo: int, hi: int) -> bool:
    """Whether `values` is a sequence (not one integer) of integers (not bools) in [lo, hi]."""
    return not isinstance(values, (int, np.integer)) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and lo <= v <= hi for v in values
    )


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """An engine's checked settings (`Engine`'s arguments of the same names).

    Attributes:
      block_tokens: state-table / prefix block size. prefill_chunk: tokens per prefill step.
      prefill_batch: most requests prefilled in one step.
      prefill_widths: the narrower prefill widths, ascending, then `prefill_chunk`.
      read_buckets: prefill and decode read sizes asked for (tokens, each in [1, max_context]).
      decode_steps: tokens per decode dispatch. restore_choice: one of `RESTORE_CHOICES`.
    """

    block_tokens: int
    prefill_chunk: int
    prefill_batch: int
    prefill_widths: tuple[int, ...]
    read_buckets: tuple[int, ...]
    decode_steps: int
    restore_choice: str

    @classmethod
    def check(
        cls,
        config: CacheConfig,
        *,
        block_tokens,
        prefill_chunk,
        prefill_batch,
        prefill_buckets: Sequence[int],
        read_buckets: Sequence[int] | None,
        decode_steps,
        restore_choice: str,
        disk,
    ) -> tuple[EngineOptions, CacheConfig]:
        """Check the settings (`ValueError` naming the bad value and the allowed range); returns them
        and the config to build the layout from: with a default-sized prefix cache (prefix_records
        and memory_bytes None) and chunks that do not end on block boundaries, the prefix cache is
        turned off, with a warning, instead of refusing a config that never asked for it."""
        prefill_chunk = _positive("prefill_chunk", prefill_chunk)
        block_tokens = _positive("block_tokens", block_tokens)
        if not _ints_in(prefill_buckets, 1, prefill_chunk - 1):
            raise ValueError(
                f"prefill_buckets={prefill_buckets!r} must be a sequence of integers in [1, {prefill_chunk}) "
                f"(narrower than prefill_chunk={prefill_chunk})"
            )
        decode_steps = _positive("decode_steps", decode_steps)
        if read_buckets is None:
            read_buckets = default_read_buckets(config.max_context)
        if not _ints_in(read_buckets, 1, config.max_context):
            raise ValueError(
                f"read_buckets={read_buckets!r} must be a sequence of integers in [1, {config.max_context}] "
                f"(token counts up to max_context={config.max_context})"
            )
        if config.prefix_records is None and config.memory_bytes is None and prefill_chunk % block_tokens:
            warnings.warn(
                f"{prefill_chunk=} is not a multiple of {block_tokens=}: the prefix cache is off (chunks must "
                f"end on block boundaries, where records are taken); pass CacheConfig(prefix_records=0) to "
                f"silence this, or a prefill_chunk that block_tokens divides to turn it on",
                stacklevel=3,
            )
            config = dataclasses.replace(config, prefix_records=0)
        if disk is not None and not isinstance(disk, (DiskTier, HostTier, TieredStore)):
            raise ValueError(f"disk={disk!r} must be an hkv.DiskTier, hkv.HostTier or hkv.TieredStore")
        if restore_choice not in RESTORE_CHOICES:
            raise ValueError(f"restore_choice={restore_choice!r} must be one of {RESTORE_CHOICES}")
        opts = cls(
            block_tokens=block_tokens,
            prefill_chunk=prefill_chunk,
            prefill_batch=_positive("prefill_batch", prefill_batch),
            prefill_widths=tuple(sorted({int(w) for w in prefill_buckets})) + (prefill_chunk,),
            read_buckets=tuple(int(r) for r in read_buckets),
            decode_steps=decode_steps,
            restore_choice=restore_choice,
        )
        return opts, config

    def check_layout(self, layout: CacheLayout, config: CacheConfig, disk) -> None:
        """Checks on the resolved layout (memory_bytes may leave no room for prefix records: prefix
        off): chunks end on block boundaries when the prefix cache is on; a disk tier needs it."""
        records = layout.config.prefix_records
        if records and self.prefill_chunk % self.block_tokens:
            raise ValueError(
                f"prefill_chunk={self.prefill_chunk} must be a multiple of block_tokens={self.block_tokens} "
                f"when the prefix cache is on (chunks end on block boundaries, where records are taken; "
                f"CacheConfig.prefix_records=0 turns it off)"
            )
        if disk is not None and records == 0:
            raise ValueError(
                "the disk tier holds prefix blocks: it needs the prefix cache "
                f"(CacheConfig.prefix_records={config.prefix_records}"
                f"{f', memory_bytes={config.memory_bytes:,}' if config.memory_bytes else ''} leaves 0 records; "
                f"prefix_records must be > 0, or None to size it)"
            )

    def read_sizes(self, config: CacheConfig, bounded: bool) -> tuple[int | None, ...]:
        """Prefill read sizes, ascending, the last max_context; (None,) when the model cannot bound
        its reads (`accepts_read_tokens` False: it reads max_context always)."""
        if not bounded:
            return (None,)
        return tuple(sorted(set(self.read_buckets) | {config.max_context}))


def text_codec(tokenizer, vocab_size: int | None = None):
    """A `TextCodec` from a codec, a folder with tokenizer.json, or a tokenizer.json path (None: None).
    With `vocab_size` (the model's): `ValueError` when the tokenizer has more token ids than that."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, TextCodec):
        codec = tokenizer
    else:
        path = Path(tokenizer)
        codec = TextCodec.from_pretrained(path) if path.is_dir() else TextCodec.from_file(path)
    if vocab_size is not None and codec.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {codec.vocab_size} token ids but the model's vocabulary has "
            f"{vocab_size}: its ids >= {vocab_size} could not be fed to the model (use the "
            f"checkpoint's own tokenizer)"
        )
    return codec


def chat_template_of(template, tokenizer):
    """The engine's `ChatTemplate`: `template` (a `ChatTemplate`, or a folder holding one), else the
    template of the checkpoint folder `tokenizer` names, else None."""
    if isinstance(template, ChatTemplate) or (template is None and not isinstance(tokenizer, (str, os.PathLike))):
        return template
    folder = Path(template if template is not None else tokenizer)
    if template is None and not folder.is_dir():
        return None
    found = ChatTemplate.from_pretrained(folder)
    if found is None and template is not None:
        raise ValueError(f"chat_template={str(template)!r}: the folder holds no chat template")
    return found


def accepts_read_tokens(model) -> bool:
    """Whether `model.cached_step` takes the optional `read_tokens` keyword (`hkv.Step.read_tokens`)."""
    return accepts_keyword(model, "read_tokens")


def accepts_snapshots(model) -> bool:
    """Whether `model.cached_step` takes the optional `snapshots` keyword (`hkv.InteriorSnapshots`):
    its prefill steps can then prepare snapshots at the block boundaries inside them."""
    return accepts_keyword(model, "snapshots")


RESTORE_CHOICES = ("cheapest", "longest")  # `Engine(restore_choice=...)`


def device_bytes() -> int | None:
    """Memory of the default device in bytes (the host's physical memory on CPU), or None if unknown."""
    dev = jax.devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # a backend without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if dev.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_fits(layout: CacheLayout) -> None:
    """`ValueError` (in the config's terms) when the cache of `layout` cannot fit the device's memory,
    before anything is allocated (a raw RESOURCE_EXHAUSTED from inside XLA otherwise)."""
    have = device_bytes()
    if have is None:
        return
    need = allocated_bytes(layout)["total"]
    if need > have:
        c = layout.config
        raise ValueError(
            f"the cache of CacheConfig(slots={c.slots}, max_context={c.max_context}, page_size={c.page_size}, "
            f"pool_pages={c.pool_pages}, prefix_records={c.prefix_records}) takes {need / 2**30:.1f} GiB, more than "
            f"the device's {have / 2**30:.1f} GiB; lower slots, max_context, pool_pages or prefix_records, or size it "
            f"with memory_bytes="
        )
