"""Decode-step benchmarks of `pallas_kernels` on a DeepSeek-V4-Flash-shaped attention layer.

Prints ratios measured in one run (absolute times depend on the machine):

* every backend: the jnp reference (reads the window + the rows it attends) against a naive
  "gather the whole context, then attend with masks" baseline, at several context lengths;
* GPU / TPU: the Pallas kernel against the XLA reference, the bytes the kernel must move and the
  achieved bandwidth as a fraction of the peak (`--peak-tbps`, H200: 4.8), and the decode-step
  time at the longest context over the shortest (the flat-cost claim);
* GPU: a small sweep of the CSA kernel's block sizes (`--sweep`).

Layer shapes (DeepSeek-V4-Flash): 64 query heads, head_dim 512, one shared K=V head, window 128,
CSA ratio 4 with top-k 512 and a 64-head x 128-dim lightning indexer, HCA ratio 128. Pages hold 64
rows. A "CSA step" is indexer top-k + sparse attention; an "HCA step" is compressed attention; a
"SWA step" is window attention. Projections, RoPE and the compressors are not included.

    python benchmarks/decode_kernels.py                      # CPU: reference vs naive, ~1-2 minutes
    python benchmarks/decode_kernels.py --batch 32 --sweep   # GPU: kernel vs reference, bandwidth
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import (
    common,
    csa_decode,
    gather,
    hca_decode,
    indexer,
    online_softmax,
    swa_decode,
    window_decode,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--contexts", default="1024,8192,65536", help="comma-separated context lengths (tokens incl. the decoded one)"
    )
    p.add_argument("--batch", type=int, default=None, help="sequences (default: 1 on CPU, 32 else)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="pool/query dtype (default: float32 on CPU, bfloat16 else)",
    )
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--csa-ratio", type=int, default=4)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--hca-ratio", type=int, default=128)
    p.add_argument("--idx-heads", type=int, default=64)
    p.add_argument("--idx-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=None, help="steps per timing (default 5 CPU, 50 else)")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="peak HBM TB/s (H200: 4.8)")
    p.add_argument(
        "--naive",
        choices=["auto", "yes", "no"],
        default="auto",
        help="time the gather-whole-context baseline (auto: on CPU only)",
    )
    p.add_argument("--sweep", action="store_true", help="GPU: sweep CSA kernel block sizes")
    p.add_argument(
        "--check",
        action="store_true",
        help="also compare kernel outputs with the reference at these shapes (on CPU: "
        "the GPU kernel in the interpreter, so use small shapes)",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Inputs: one layer's pools for `batch` sequences of `context` tokens, pages in random order.
# ----------------------------------------------------------------------------------------------
def _paged(rng, batch, rows, dim, page_size, dtype):
    """A pool holding `rows` rows per sequence in random physical pages, and its page table."""
    pages_per_seq = max(-(-rows // page_size), 1)
    num_pages = batch * pages_per_seq
    pool = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (num_pages, page_size, dim), jnp.float32).astype(
        dtype
    )
    table = rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32)
    return pool, jnp.asarray(table)


def build_layer(args, batch, context, dtype, seed=0):
    rng = np.random.default_rng(seed)
    f32 = jnp.float32
    n_csa, n_hca = context // args.csa_ratio, context // args.hca_ratio
    window_pool, window_table = _paged(rng, batch, context, args.head_dim, args.page_size, dtype)
    csa_pool, csa_table = _paged(rng, batch, n_csa, args.head_dim, args.page_size, dtype)
    hca_pool, hca_table = _paged(rng, batch, n_hca, args.head_dim, args.page_size, dtype)
    idx_pool, idx_table = _paged(rng, batch, n_csa, args.idx_dim, args.page_size, dtype)
    key = jax.random.key(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    layer = dict(
        q=jax.random.normal(k1, (batch, args.heads, args.head_dim), f32).astype(dtype),
        sinks=jax.random.normal(k2, (args.heads,), f32),
        window_pool=window_pool,
        window_table=window_table,
        lengths=jnp.full((batch,), context, jnp.int32),
        csa_pool=csa_pool,
        csa_table=csa_table,
        n_csa=jnp.full((batch,), n_csa, jnp.int32),
        hca_pool=hca_pool,
        hca_table=hca_table,
        n_hca=jnp.full((batch,), n_hca, jnp.int32),
        idx_pool=idx_pool,
        idx_table=idx_table,
        q_idx=jax.random.normal(k3, (batch, args.idx_heads, args.idx_dim), f32).astype(dtype),
        idx_weights=(jax.random.normal(k4, (batch, args.idx_heads), f32) * args.idx_heads**-0.5).astype(dtype),
    )
    layer["topk"] = indexer.indexer_topk(
        layer["q_idx"],
        layer["idx_weights"],
        idx_pool,
        idx_table,
        layer["lengths"],
        layer["n_csa"],
        k=args.topk,
        compress_ratio=args.csa_ratio,
        backend="reference",
    )
    return layer


# ----------------------------------------------------------------------------------------------
# The ops as q -> out functions (so a timing loop can feed each output back as the next query).
# ----------------------------------------------------------------------------------------------
def ops(args, layer, backend, interpret=False):
    L = layer
    kw = dict(backend=backend, interpret=interpret)
    swa = lambda q: swa_decode.swa_decode_attention(
        q, L["window_pool"], L["window_table"], L["lengths"], L["sinks"], window=args.window, **kw
    )
    hca = lambda q: hca_decode.hca_decode_attention(
        q,
        L["window_pool"],
        L["window_table"],
        L["lengths"],
        L["sinks"],
        L["hca_pool"],
        L["hca_table"],
        L["n_hca"],
        window=args.window,
        compress_ratio=args.hca_ratio,
        **kw,
    )
    csa_attn = lambda q: csa_decode.csa_decode_attention(
        q,
        *_csa_args(L, L["n_csa"]),
        L["topk"],
        window=args.window,
        compress_ratio=args.csa_ratio,
        **kw,
    )

    def csa_step(q):
        # The indexer query is tied to q so the timing loop cannot hoist the top-k out of it.
        q_idx = L["q_idx"] + (q[0, 0, 0] * 0).astype(L["q_idx"].dtype)
        picks = indexer.indexer_topk(
            q_idx,
            L["idx_weights"],
            L["idx_pool"],
            L["idx_table"],
            L["lengths"],
            L["n_csa"],
            k=args.topk,
            compress_ratio=args.csa_ratio,
            **kw,
        )
        return csa_decode.csa_decode_attention(
            q,
            *_csa_args(L, L["n_csa"]),
            picks,
            window=args.window,
            compress_ratio=args.csa_ratio,
            **kw,
        )

    return {"swa": swa, "hca": hca, "csa_attention": csa_attn, "csa_step": csa_step}


def _csa_args(L, n_entries):
    """A CSA attention's paged inputs after the query: window pool and table, lengths, sinks, CSA pool
    and table, and the CSA entries per sequence (`n_entries`); the top-k picks follow them."""
    return (L["window_pool"], L["window_table"], L["lengths"], L["sinks"], L["csa_pool"], L["csa_table"], n_entries)


def check(args, layer, context, kernel_backend, interpret):
    """Kernel vs reference at benchmark shapes; returns False if any op is out of tolerance."""
    L = layer
    tol = dict(atol=2e-2, rtol=2e-2) if L["q"].dtype == jnp.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    ok = True
    kernel, ref = ops(args, layer, kernel_backend, interpret), ops(args, layer, "reference")
    for name in ("swa", "hca", "csa_attention"):
        got = np.asarray(kernel[name](L["q"]).astype(jnp.float32))
        want = np.asarray(ref[name](L["q"]).astype(jnp.float32))
        err = np.abs(got - want)
        passed = bool(np.isfinite(got).all() and (err <= tol["atol"] + tol["rtol"] * np.abs(want)).all())
        ok &= passed
        print(
            f"check {name:14s} ctx={context:6d}  max|kernel - reference| = {err.max():.3e}  "
            f"{'PASS' if passed else 'FAIL'}",
            flush=True,
        )
    idx_args = (L["q_idx"], L["idx_weights"], L["idx_pool"], L["idx_table"], L["lengths"], L["n_csa"])
    got = np.asarray(
        indexer.indexer_scores(*idx_args, compress_ratio=args.csa_ratio, backend=kernel_backend, interpret=interpret)
    )
    want = np.asarray(indexer.indexer_scores(*idx_args, compress_ratio=args.csa_ratio, backend="reference"))
    finite = np.isfinite(want)
    err = np.abs(got[finite] - want[finite]).max(initial=0.0)
    rel = err / max(np.abs(want[finite]).max(initial=0.0), 1e-30)
    picks = np.asarray(
        indexer.indexer_topk(
            *idx_args, k=args.topk, compress_ratio=args.csa_ratio, backend=kernel_backend, interpret=interpret
        )
    )
    same = np.mean(picks == np.asarray(L["topk"]))
    passed = bool((np.isneginf(got) == ~finite).all() and rel < 1e-3)
    ok &= passed
    print(
        f"check {'indexer':14s} ctx={context:6d}  max rel score error = {rel:.3e}, picks equal "
        f"to the reference's: {same * 100:.1f}% (bf16 near-ties may swap)  "
        f"{'PASS' if passed else 'FAIL'}",
        flush=True,
    )
    return ok


def naive_ops(args, layer):
    """Gather the whole context (and every compressed entry), then attend with dense masks."""
    L = layer
    scale = args.head_dim**-0.5

    def window_rows():
        rows = gather.paged_gather_reference(L["window_pool"], L["window_table"], L["lengths"])
        t = L["lengths"][:, None] - 1
        pos = jnp.arange(rows.shape[1])[None, :]
        return rows, (pos > t - args.window) & (pos <= t)

    def swa(q):
        rows, valid = window_rows()
        return online_softmax.attend_rows_reference(q, rows, valid, L["sinks"], scale)

    def hca(q):
        rows, valid = window_rows()
        comp = gather.paged_gather_reference(L["hca_pool"], L["hca_table"], L["n_hca"])
        comp_valid = jnp.arange(comp.shape[1])[None, :] < L["n_hca"][:, None]
        return online_softmax.attend_rows_reference(
            q, jnp.concatenate([rows, comp], 1), jnp.concatenate([valid, comp_valid], 1), L["sinks"], scale
        )

    def csa_attn(q):
        rows, valid = window_rows()
        comp = gather.paged_gather_reference(L["csa_pool"], L["csa_table"], L["n_csa"])
        picks = L["topk"]
        batch = jnp.arange(picks.shape[0])[:, None]
        selected = (
            jnp.zeros(comp.shape[:2], bool)
            .at[batch, jnp.where(picks >= 0, picks, comp.shape[1])]
            .set(True, mode="drop")
        )
        return online_softmax.attend_rows_reference(
            q, jnp.concatenate([rows, comp], 1), jnp.concatenate([valid, selected], 1), L["sinks"], scale
        )

    return {"swa": swa, "hca": hca, "csa_attention": csa_attn}


def bytes_moved(args, layer, op, context, itemsize):
    """Bytes an op must read and write per call (rows it attends, queries, outputs)."""
    batch = layer["q"].shape[0]
    window_rows = min(context, args.window)
    q_out = 2 * args.heads * args.head_dim * itemsize
    picks = int((np.asarray(layer["topk"]) >= 0).sum()) // batch
    rows = {
        "swa": window_rows,
        "hca": window_rows + context // args.hca_ratio,
        "csa_attention": window_rows + picks,
        "csa_step": window_rows + picks,
    }[op]
    total = rows * args.head_dim * itemsize + q_out
    if op == "csa_step":  # the indexer reads every visible index key
        total += (context // args.csa_ratio) * args.idx_dim * itemsize
    return batch * total


# ----------------------------------------------------------------------------------------------
# Timing.
# ----------------------------------------------------------------------------------------------
def time_op(make, layer, q, iters, repeats=5, unroll=False):
    """Seconds per call of the op `make(layer)` returns: `iters` calls inside one jitted loop, best of
    `repeats` loops (the minimum, not the median, so that other load on a shared machine does not
    inflate it). The layer's arrays are arguments of the jitted loop, not constants captured by it
    (at 64K context the pools are GBs: as constants they took minutes to lower). `unroll` (on GPU):
    the loop's calls are one straight sequence of kernels, with no device-to-host loop test between
    them, as in a model's decode step."""
    loop = jax.jit(lambda q, L: lax.fori_loop(0, iters, lambda i, x: make(L)(x).astype(x.dtype), q, unroll=unroll))
    jax.block_until_ready(loop(q, layer))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(loop(q, layer))
        times.append((time.perf_counter() - start) / iters)
    return min(times)


def main(argv=None):
    args = parse_args(argv)
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    kernel_backend = None if on_cpu else ("tpu" if platform == "tpu" else "gpu")
    batch = args.batch or (1 if on_cpu else 32)
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    iters = args.iters or (5 if on_cpu else 50)
    naive = args.naive == "yes" or (args.naive == "auto" and on_cpu)
    contexts = [int(c) for c in args.contexts.split(",")]
    device = jax.devices()[0]
    print(f"# pallas_kernels decode benchmark, {datetime.date.today().isoformat()}")
    print(f"# jax {jax.__version__}, backend={platform}, device={device.device_kind}, {len(jax.devices())} device(s)")
    print(
        f"# layer: heads={args.heads} head_dim={args.head_dim} window={args.window} "
        f"page_size={args.page_size} CSA m={args.csa_ratio} top-k={args.topk} "
        f"indexer {args.idx_heads}x{args.idx_dim} HCA m={args.hca_ratio}; batch={batch} "
        f"dtype={dtype.name} iters={iters}"
    )
    if on_cpu:
        print(
            "# CPU: no Pallas kernel timing (kernels run only interpreted on CPU); comparing the "
            "jnp reference with the naive gather-whole-context baseline"
        )
    else:
        print(
            f"# {platform.upper()}: Pallas kernel (backend={kernel_backend!r}) vs XLA reference; "
            f"peak {args.peak_tbps} TB/s"
        )

    results = {}
    all_passed = True
    for context in contexts:
        layer = build_layer(args, batch, context, dtype)
        if args.check:
            all_passed &= check(args, layer, context, kernel_backend or "gpu", interpret=on_cpu)
        unroll = not on_cpu
        for name in ops(args, layer, "reference"):
            ref = lambda L, name=name: ops(args, L, "reference")[name]
            row = {"ref": time_op(ref, layer, layer["q"], iters, unroll=unroll)}
            if not on_cpu:
                kernel = lambda L, name=name: ops(args, L, kernel_backend)[name]
                row["kernel"] = time_op(kernel, layer, layer["q"], iters, unroll=unroll)
                row["bytes"] = bytes_moved(args, layer, name, context, dtype.itemsize)
            if naive and name in ("swa", "hca", "csa_attention"):
                base = lambda L, name=name: naive_ops(args, L)[name]
                row["naive"] = time_op(base, layer, layer["q"], max(1, iters // 2), repeats=3, unroll=unroll)
            results[(name, context)] = row
            _print_row(name, context, row, args.peak_tbps)
        del layer
    _print_growth(results, contexts, "kernel" if not on_cpu else "ref")
    if args.sweep and platform == "gpu":
        _sweep(args, batch, max(contexts), dtype, iters)
    if args.check:
        print(f"# checks: {'all PASS' if all_passed else 'FAILURES above'}")
        return 0 if all_passed else 1
    return 0


def _print_row(name, context, row, peak_tbps):
    parts = [f"{name:14s} ctx={context:6d}  reference {row['ref'] * 1e3:9.3f} ms"]
    if "naive" in row:
        parts.append(f"naive {row['naive'] * 1e3:9.3f} ms  naive/reference {row['naive'] / row['ref']:7.1f}x")
    if "kernel" in row:
        gbps = row["bytes"] / row["kernel"] / 1e9
        parts.append(
            f"kernel {row['kernel'] * 1e3:8.3f} ms  reference/kernel "
            f"{row['ref'] / row['kernel']:5.2f}x  {row['bytes'] / 1e6:8.2f} MB  "
            f"{gbps:7.1f} GB/s = {gbps / (peak_tbps * 1e3) * 100:5.1f}% of peak"
        )
    print("  ".join(parts), flush=True)


def _print_growth(results, contexts, column):
    lo, hi = min(contexts), max(contexts)
    if lo == hi:
        return
    print(f"# step time at {hi} tokens / at {lo} tokens ({column}):")
    for name in ("swa", "csa_attention", "csa_step", "hca"):
        if (name, lo) in results and (name, hi) in results:
            ratio = results[(name, hi)][column] / results[(name, lo)][column]
            print(f"  {name:14s} {ratio:6.2f}x")
        if column == "ref" and (name, hi) in results and "naive" in results[(name, hi)]:
            ratio = results[(name, hi)]["naive"] / results[(name, lo)]["naive"]
            print(f"  {name:14s} {ratio:6.2f}x  (naive baseline)")


def _sweep(args, batch, context, dtype, iters):
    """CSA attention kernel at several (block_h, block_k, num_warps)."""
    layer = build_layer(args, batch, context, dtype)
    L = layer
    capacity = L["csa_table"].shape[1] * L["csa_pool"].shape[1]
    n_visible = common.visible_entries(L["lengths"], L["n_csa"], args.csa_ratio, capacity)
    scale = args.head_dim**-0.5
    nbytes = bytes_moved(args, layer, "csa_attention", context, dtype.itemsize)
    print(f"# CSA attention kernel sweep at ctx={context}:")
    for block_h, block_k, num_warps in [(16, 32, 4), (16, 64, 4), (32, 32, 4), (32, 32, 8), (64, 16, 8), (64, 32, 8)]:
        fn = functools.partial(
            window_decode.window_decode_gpu,  # CSA: the picks are its 9th argument, after n_visible
            window=args.window,
            scale=scale,
            interpret=False,
            block_h=block_h,
            block_k=block_k,
            num_warps=num_warps,
        )
        make = lambda L, fn=fn: lambda q: fn(q, *_csa_args(L, L["n_visible"]), L["topk"])
        try:
            t = time_op(make, dict(L, n_visible=n_visible), L["q"], iters, unroll=True)
        except Exception as e:  # a config that does not compile is reported, not fatal
            print(
                f"  block_h={block_h:3d} block_k={block_k:3d} warps={num_warps}: failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            )
            continue
        print(
            f"  block_h={block_h:3d} block_k={block_k:3d} warps={num_warps}: {t * 1e3:8.3f} ms "
            f"{nbytes / t / 1e9:7.1f} GB/s",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
