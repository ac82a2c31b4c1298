"""Loading a many-shard release-format DeepSeek-V4 checkpoint onto a mesh of host devices against the
disk's sequential read speed, both measured in the same run (issue 45, item 6).

    python benchmarks/load.py            # ~0.9 GB checkpoint in 64 MiB shards, 3 repeats (~2-3 min)
    python benchmarks/load.py --quick    # ~0.1 GB in 16 MiB shards, 2 repeats (smoke run)

The checkpoint: `write_release_checkpoint` of random weights for a DeepSeek-V4 of `--hidden` hidden
size, `--experts` routed experts of `--inter` and 4 layers (FP8 e4m3 attention and shared experts with
128x128 float32 block scales, packed FP4 routed experts with ue8m0 scales per 32, the rest bf16;
each tensor made when written, `RandomTensors`),
written in `--shard-mib` shards.

Measured, each best (median) of `--repeats`, the checkpoint's files dropped from this VM's page cache
before each (`posix_fadvise(DONTNEED)`; the virtual disk's host may still cache):
  seq read   a file of the checkpoint's size read with `readinto` in 16 MiB pieces.
  load       `deepseek_v4.load(path, dtype=bfloat16, mesh=Mesh(8 host devices, (1, 8)))` until every
             weight is ready: the headers parsed, each device's slice read from the memory-mapped
             shards and put on it (`models.placement.OnMesh`), layers stacked. Checkpoint bytes / time.
Ratio: load / seq read (target >= 0.5).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import glob
import shutil
import tempfile
import time
import zlib
from collections.abc import Mapping

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from disk_tier import drop_page_cache
from host_tier import best_med, seq_read_gbs
from jax.sharding import Mesh

from models.deepseek_v4 import load, tiny_config
from models.deepseek_v4.release import write_release_checkpoint
from models.deepseek_v4.tensor_layout import expected_tensors

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


class RandomTensors(Mapping):
    """Canonical tensors of `cfg`, each made when asked for (normal(0, 0.02), ones for norms and mHC
    scales, a token->expert table for hash layers; 2-D float tensors in bf16), so that writing a
    checkpoint never holds its float32 weights all at once."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.shapes = {k: shape for k, (shape, _) in expected_tensors(cfg).items()}

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        if name.endswith("tid2eid"):
            return np.argsort(rng.random((shape[0], self.cfg.n_routed_experts)), axis=1)[:, : shape[1]]
        if name.endswith("norm.weight") or name.endswith("_scale"):
            return np.ones(shape, np.float32)
        a = rng.standard_normal(shape, np.float32) * np.float32(0.02)
        return a.astype(ml_dtypes.bfloat16) if a.ndim == 2 else a

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def checkpoint(root: str, hidden: int, inter: int, experts: int, shard_mib: int) -> tuple[str, int, int]:
    """(path, bytes of its safetensors files, number of them) of a freshly written release checkpoint."""
    cfg = tiny_config(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        n_routed_experts=experts,
        q_lora_rank=hidden // 2,
        vocab_size=8192,
    )
    path = os.path.join(root, "ckpt")
    write_release_checkpoint(path, cfg, RandomTensors(cfg), max_shard_bytes=shard_mib << 20)
    files = glob.glob(os.path.join(path, "*.safetensors"))
    return path, sum(os.path.getsize(f) for f in files), len(files)


def run(args, root: str) -> dict:
    say(f"{_machine.cores()} cores, hkv {_machine.hkv_revision()}, {len(jax.devices())} host devices")
    path, nbytes, nfiles = checkpoint(root, args.hidden, args.inter, args.experts, args.shard_mib)
    say(f"checkpoint: {nbytes / 1e9:.2f} GB in {nfiles} shards")
    seq = seq_read_gbs(os.path.join(root, "seq.bin"), nbytes, args.repeats)
    say(f"seq read (cold): {seq[0]:.2f} GB/s best, {seq[1]:.2f} median (warm {seq[2]:.2f})")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "model"))

    def one() -> None:
        model = load(path, dtype=jnp.bfloat16, mesh=mesh, progress_bars=False)
        jax.block_until_ready(jax.tree.leaves(model))

    one()  # compile the layer stacking once
    best, med = best_med(one, args.repeats, lambda: drop_page_cache(path))
    out = {"bytes": nbytes, "seq": seq, "load": (nbytes / best / 1e9, nbytes / med / 1e9)}
    say(f"load onto 8 devices (cold): {out['load'][0]:.2f} GB/s best, {out['load'][1]:.2f} median")
    say(f"load / seq read: {out['load'][0] / seq[0]:.2f} best, {out['load'][1] / seq[1]:.2f} median (target >= 0.5)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--shard-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temporary dir)")
    ap.add_argument("--quick", action="store_true", help="hidden 1024, inter 512, 32 experts, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.inter, args.experts, args.repeats, args.shard_mib = 1024, 512, 32, 2, 16
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
