"""On paper, to internet scale: DeepSeek-V4-Flash KV-cache figures for 8xH200 and a TPU v5p-16 slice.

    python benchmarks/scaling.py          # readable report (the tables of docs/scaling.md)
    python benchmarks/scaling.py --json   # the same numbers as JSON

Every figure is computed here from hkv's own functions and the model config (shape arithmetic only:
nothing is allocated, no weights are read): bytes of KV state per token (`architectural_minimum`,
`allocated_bytes` of a 64-token-page layout, `uniform_full_kv_bytes`), weight bytes from the tensors
`models.deepseek_v4.tensor_layout.expected_tensors` lists for the real config, what is left for the cache
per device under a stated parallel layout, how many 128K / 1M contexts fit, the bytes of one restored
prefix as the disk tier stores it (`hkv.engine.offload.expected_objects`, 64-byte aligned) and the store
bandwidth R restores per second need, and the size of the store's index at 1,000 hosts. The hardware
figures below are the only inputs that are not hkv's; each names its source.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math

# ---------------------------------------------------------------------------------------------------------
# Hardware and deployment assumptions (the only numbers not computed from hkv or the config).
# NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s. "GB" is decimal here (nvidia-smi shows ~140 GiB,
# so this is slightly conservative).
H200_HBM_BYTES = 141 * 10**9
H200_HBM_BYTES_PER_S = 4.8e12
H200_PER_NODE = 8  # DGX/HGX H200: 8 GPUs on NVSwitch (NVIDIA DGX BasePOD reference architecture)
# PCIe 5.0 x16 host<->GPU, per direction (32 GT/s x 16 lanes, 128b/130b): ~63 GB/s nominal.
H200_PCIE_BYTES_PER_S = 63e9
# DGX H200 storage/cache: eight 3.84 TB U.2 NVMe drives (NVIDIA DGX BasePOD reference architecture).
NODE_NVME_DRIVES = 8
NVME_DRIVE_BYTES = 3.84e12
# Sequential read of one enterprise PCIe 4.0 x4 U.2 drive (vendor datasheets of that class: ~7 GB/s).
# An assumption: the DGX datasheet does not name the drive model.
NVME_DRIVE_READ_BYTES_PER_S = 7e9
# DGX H200 storage fabric: 2x dual-port ConnectX-7, up to 400 Gb/s (line rate, an upper bound).
NODE_STORAGE_NIC_BYTES_PER_S = 2 * 400e9 / 8
# hkv's DiskTier as measured (benchmarks/README.md, disk_tier.py part 1: file store, page cache dropped,
# 2-core VM): 458 MB/s, 0.43x the raw reads of the same files. The only measured figure here.
MEASURED_DISKTIER_READ_BYTES_PER_S = 458e6

# Google Cloud TPU v5p documentation: 95 GiB HBM per chip, 2,765 GB/s, 4 chips per host (VM),
# data-center network (DCN) 50 Gb/s per chip.
V5P_HBM_BYTES = 95 * 2**30
V5P_HBM_BYTES_PER_S = 2.765e12
V5P_CHIPS_PER_HOST = 4
V5P_DCN_BYTES_PER_S_PER_CHIP = 50e9 / 8
# v5p-16 = 8 chips (v5p-N counts TensorCores, 2 per chip), 2 hosts: the smallest v5p slice whose HBM
# (760 GiB) holds the bf16 weights hkv loads today, and the same chip count as one 8xH200 node.
V5P_SLICE = "v5p-16"
V5P_SLICE_CHIPS = 8

# HBM kept back for activations, XLA workspace and the cache's own metadata (page tables, state table,
# prefix index): 10%, as vLLM's default gpu_memory_utilization=0.9. An assumption, not measured.
RESERVE_FRACTION = 0.10

# Object stores list at most 1,000 keys per LIST request (S3 ListObjectsV2 MaxKeys, GCS default page).
LIST_PAGE_KEYS = 1000
HOSTS = 1000  # "what changes at 1,000 hosts"
BLOOM_FALSE_POSITIVE = 0.01

# ---------------------------------------------------------------------------------------------------------
CONTEXTS = (128 * 1024, 1024 * 1024)
RESTORE_LENGTHS = (8 * 1024, 32 * 1024, 128 * 1024, 1024 * 1024)
RESTORE_RATES = (1, 10, 100)  # prefix restores per second (per node)
PAGE_SIZE = 64
BLOCK_TOKENS = 64
KINDS = ("SWA", "COMPRESSED", "INDEXER", "TAIL")
GB = 10**9
GIB = 2**30


def flash():
    """(config, cache spec) of DeepSeek-V4-Flash as benchmarks/memory.py builds them: bf16, 64-token blocks."""
    from models.deepseek_v4 import flash_config
    from models.deepseek_v4.cache_spec import cache_spec

    cfg = flash_config()
    return cfg, cache_spec(cfg, dtype="bfloat16", block_tokens=BLOCK_TOKENS, model_id="deepseek-v4-flash")


def layout_for(spec, context: int, slots: int = 1):
    from hkv import CacheConfig, CacheLayout

    return CacheLayout(spec, CacheConfig(slots=slots, max_context=context, page_size=PAGE_SIZE, prefix_records=0))


# --------------------------------------------------------------------------------------------- KV state
def kv_state(spec, context: int) -> dict:
    """Bytes of one sequence's cache state at `context` tokens: minimum, hkv allocation, uniform full KV."""
    from hkv import architectural_minimum, uniform_full_kv_bytes
    from hkv.core.memory import allocated_bytes

    minimum = architectural_minimum(spec, context)
    alloc = allocated_bytes(layout_for(spec, context))
    full = uniform_full_kv_bytes(spec, context, page_size=PAGE_SIZE)
    return {
        "context": context,
        "minimum": minimum,
        "allocated": alloc,
        "uniform_full_kv": full,
        "minimum_per_token": minimum["total"] / context,
        "allocated_per_token": alloc["total"] / context,
        "uniform_full_kv_per_token": full / context,
        "full_over_minimum": full / minimum["total"],
    }


# ----------------------------------------------------------------------------------------------- weights
FLOAT32_SUFFIXES = ("norm.weight", "_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")


def tensor_group(name: str) -> str:
    """Which part of the model a canonical tensor belongs to (decides how it is sharded)."""
    if name in ("embed.weight", "head.weight"):
        return "embed_head"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if ".ffn.gate." in name:
        return "router"
    if ".attn." in name:
        return "attention"
    return "other"  # norms and hyper-connection mixers


def bytes_as_loaded(name: str, shape: tuple[int, ...], kind: str) -> int:
    """Device bytes of a tensor as `models.deepseek_v4.load(dtype=bfloat16)` holds it today: float32 for
    norms, hyper-connections, sinks, position biases and router biases, int32 for `tid2eid`, bf16 else."""
    n = math.prod(shape)
    if kind == "int":
        return 4 * n
    return (4 if name.endswith(FLOAT32_SUFFIXES) else 2) * n


def bytes_as_released(name: str, shape: tuple[int, ...], kind: str) -> int:
    """Bytes of a tensor in the release's mixed precision (the formats `checkpoint.py` reads): routed
    experts FP4 e2m1 (two per byte) + one ue8m0 scale byte per 32; the other linear weights of a layer
    FP8 e4m3 + a float32 scale per 128x128 block; router, embedding and head bf16; float32 small tensors."""
    n = math.prod(shape)
    group = tensor_group(name)
    if kind == "int" or name.endswith(FLOAT32_SUFFIXES) or group in ("embed_head", "router"):
        return bytes_as_loaded(name, shape, kind)
    if group == "routed_experts":
        return n // 2 + n // 32
    if len(shape) == 2:
        return n + 4 * math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
    return bytes_as_loaded(name, shape, kind)


def weights(cfg) -> dict:
    """Parameter counts and bytes per group (from `expected_tensors(cfg)`: shapes only)."""
    from models.deepseek_v4.tensor_layout import expected_tensors

    params: dict[str, int] = {}
    loaded: dict[str, int] = {}
    released: dict[str, int] = {}
    for name, (shape, kind) in expected_tensors(cfg).items():
        g = tensor_group(name)
        if kind != "int":
            params[g] = params.get(g, 0) + math.prod(shape)
        loaded[g] = loaded.get(g, 0) + bytes_as_loaded(name, shape, kind)
        released[g] = released.get(g, 0) + bytes_as_released(name, shape, kind)
    total = sum(params.values())
    routed = params["routed_experts"]
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {
        "params": params,
        "params_total": total,
        "params_active_per_token": active,
        "bytes": {"bf16": loaded, "release": released},
        "bytes_total": {"bf16": sum(loaded.values()), "release": sum(released.values())},
    }


def per_device_weights(w: dict, precision: str, devices: int) -> dict:
    """Weight bytes on each of `devices` devices under two layouts.

    dp_attention_ep (the planned layout): attention is data parallel (each device owns its sequences and
    their whole cache, so attention, shared experts, router and mixers are replicated), routed experts
    are expert parallel (n_routed_experts / devices per device), embedding and head are vocab parallel.
    even: every byte split evenly (a lower bound; tensor-parallel attention gets close to it, but then
    the single shared K=V head replicates every sequence's cache on every device).
    """
    b = w["bytes"][precision]
    sharded = b["routed_experts"] + b["embed_head"]
    replicated = sum(b.values()) - sharded
    return {"dp_attention_ep": replicated + -(-sharded // devices), "even": -(-sum(b.values()) // devices)}


# ------------------------------------------------------------------------------------------- capacity
def platforms() -> dict:
    return {
        "8xH200": {"hbm": H200_HBM_BYTES, "hbm_bw": H200_HBM_BYTES_PER_S, "devices": H200_PER_NODE},
        V5P_SLICE: {"hbm": V5P_HBM_BYTES, "hbm_bw": V5P_HBM_BYTES_PER_S, "devices": V5P_SLICE_CHIPS},
    }


def capacity(w: dict, kv: dict[int, dict]) -> list[dict]:
    """Per platform x weight precision: bytes left for the cache per device, and contexts that fit
    (pools are linear in slots: `allocated_bytes` of n slots is n x one slot's; the test checks it)."""
    rows = []
    for plat, p in platforms().items():
        usable = int(p["hbm"] * (1 - RESERVE_FRACTION))
        for precision in ("bf16", "release"):
            wd = per_device_weights(w, precision, p["devices"])
            left = usable - wd["dp_attention_ep"]
            left_tp = usable - wd["even"]
            row = {
                "platform": plat,
                "precision": precision,
                "devices": p["devices"],
                "hbm": p["hbm"],
                "usable": usable,
                "weights_per_device": wd["dp_attention_ep"],
                "weights_even_split": wd["even"],
                "cache_per_device": left,
                "contexts": {},
            }
            for n, k in kv.items():
                per_device = max(left // k["allocated"]["total"], 0)
                full = max(left // k["uniform_full_kv"], 0)
                tp = max(left_tp // k["allocated"]["total"], 0)
                row["contexts"][n] = {
                    "per_device": per_device,
                    "per_node": per_device * p["devices"],
                    "uniform_full_kv_per_node": full * p["devices"],
                    "tp_attention_per_node": tp,  # the single K=V head: every device holds every sequence
                    "minimum_bytes_held": per_device * k["minimum"]["total"],
                }
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------- restore / store
def restored_prefix_bytes(spec, length: int) -> dict:
    """Bytes the disk tier reads to restore a prefix of `length` tokens: every block's COMPRESSED and
    INDEXER rows and the SWA window + TAIL snapshot of the last block, each object 64-byte aligned as
    `DiskTier` lays it out (manifest JSON not included)."""
    from hkv.engine.offload import expected_objects
    from hkv.store.manifest import ALIGN

    lay = layout_for(spec, length)
    bt = spec.block_tokens
    if length % bt:
        raise ValueError(f"{length=} must be a multiple of block_tokens={bt}")

    def size(objs) -> int:
        return sum(-(-math.prod(s) * dt.itemsize // ALIGN) * ALIGN for dt, s in objs.values())

    period = math.lcm(bt, *(g.unit for g in lay.groups))  # a block's objects depend on length mod period
    memo: dict[int, int] = {}
    rows = 0
    for i in range(length // bt - 1):
        end = (i + 1) * bt
        key = end % period if end >= period else end
        if key not in memo:
            memo[key] = size(expected_objects(lay, end, False))
        rows += memo[key]
    last = expected_objects(lay, length, True)
    last_rows = size({k: v for k, v in last.items() if k.endswith(".rows")})
    snapshot = size({k: v for k, v in last.items() if not k.endswith(".rows")})
    return {"length": length, "rows": rows + last_rows, "snapshot": snapshot, "total": rows + last_rows + snapshot}


def restore_table(spec) -> list[dict]:
    from hkv import uniform_full_kv_bytes

    out = []
    for n in RESTORE_LENGTHS:
        r = restored_prefix_bytes(spec, n)
        full = uniform_full_kv_bytes(spec, n, page_size=PAGE_SIZE)
        out.append(
            {
                **r,
                "uniform_full_kv": full,
                "blocks": n // spec.block_tokens,
                "rates": {rate: {"hkv": rate * r["total"], "uniform_full_kv": rate * full} for rate in RESTORE_RATES},
                "node_nvme_prefixes": int(NODE_NVME_DRIVES * NVME_DRIVE_BYTES // r["total"]),
                "node_nvme_prefixes_full_kv": int(NODE_NVME_DRIVES * NVME_DRIVE_BYTES // full),
            }
        )
    return out


def links() -> dict[str, float]:
    """Bytes per second of the links a restore may cross (assumptions above, one measured)."""
    return {
        "one NVMe drive (assumed)": NVME_DRIVE_READ_BYTES_PER_S,
        "8 NVMe drives of one H200 node": NODE_NVME_DRIVES * NVME_DRIVE_READ_BYTES_PER_S,
        "H200 node storage NIC (line rate)": NODE_STORAGE_NIC_BYTES_PER_S,
        "one H200's PCIe 5.0 x16 (host to device)": H200_PCIE_BYTES_PER_S,
        "v5p host DCN (4 chips x 50 Gb/s)": V5P_CHIPS_PER_HOST * V5P_DCN_BYTES_PER_S_PER_CHIP,
        "hkv DiskTier, measured on the 2-core VM": MEASURED_DISKTIER_READ_BYTES_PER_S,
    }


def fleet(spec) -> dict:
    """The store's index at HOSTS hosts, each contributing its node's NVMe: blocks, segments, LIST pages."""
    from hkv.store.tier import DiskTier

    defaults = inspect.signature(DiskTier.__init__).parameters
    seg_bytes = defaults["max_segment_bytes"].default
    refresh_s = defaults["refresh_seconds"].default
    # the average stored block of a long cached chain: the 128K prefix's rows per block (snapshots aside)
    r = restored_prefix_bytes(spec, 128 * 1024)
    block = r["rows"] / (r["length"] // spec.block_tokens)
    store = HOSTS * NODE_NVME_DRIVES * NVME_DRIVE_BYTES
    blocks = store / block
    segments = store / seg_bytes
    bits = -math.log(BLOOM_FALSE_POSITIVE) / math.log(2) ** 2
    return {
        "hosts": HOSTS,
        "store_bytes": store,
        "block_bytes": block,
        "blocks": blocks,
        "max_segment_bytes": seg_bytes,
        "segments": segments,
        "refresh_seconds": refresh_s,
        "list_pages_per_refresh": math.ceil(segments / LIST_PAGE_KEYS),
        "list_requests_per_s_all_hosts": HOSTS * math.ceil(segments / LIST_PAGE_KEYS) / refresh_s,
        "bloom_bits_per_key": bits,
        "bloom_bytes_total": blocks * bits / 8,
        "bloom_bytes_per_host": blocks * bits / 8 / HOSTS,
    }


def compute() -> dict:
    cfg, spec = flash()
    kv = {n: kv_state(spec, n) for n in CONTEXTS}
    w = weights(cfg)
    return {
        "model": {
            "layers": cfg.num_hidden_layers,
            "csa_layers": sum(t == "compressed_sparse_attention" for t in cfg.layer_types),
            "hca_layers": sum(t == "heavily_compressed_attention" for t in cfg.layer_types),
            "head_dim": cfg.head_dim,
            "index_head_dim": cfg.index_head_dim,
            "window": cfg.sliding_window,
            "block_tokens": spec.block_tokens,
            "page_size": PAGE_SIZE,
        },
        "kv": kv,
        "weights": w,
        "capacity": capacity(w, kv),
        "restore": restore_table(spec),
        "links": links(),
        "fleet": fleet(spec),
        "assumptions": {
            "reserve_fraction": RESERVE_FRACTION,
            "nvme_node_read_bytes_per_s": NODE_NVME_DRIVES * NVME_DRIVE_READ_BYTES_PER_S,
            "nvme_node_bytes": NODE_NVME_DRIVES * NVME_DRIVE_BYTES,
            "h200_pcie_bytes_per_s": H200_PCIE_BYTES_PER_S,
            "node_storage_nic_bytes_per_s": NODE_STORAGE_NIC_BYTES_PER_S,
            "v5p_host_dcn_bytes_per_s": V5P_CHIPS_PER_HOST * V5P_DCN_BYTES_PER_S_PER_CHIP,
        },
    }


# ---------------------------------------------------------------------------------------------- render
def _k(n: int) -> str:
    return f"{n // (1024 * 1024)}M" if n >= 1024 * 1024 else f"{n // 1024}K"


def _gb(b: float, digits: int = 2) -> str:
    return f"{b / GB:,.{digits}f}"


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def tables(d: dict) -> dict[str, str]:
    """The markdown tables docs/scaling.md quotes, keyed by name (the test checks each appears verbatim)."""
    out = {}
    lines = [
        _row("context", "object", "architectural minimum", "hkv allocates (64-token pages)", "uniform full KV"),
        "|---|---|---|---|---|",
    ]
    for n, k in d["kv"].items():
        for kind in KINDS + ("total",):
            full = f"{k['uniform_full_kv'] / n:,.0f}" if kind == "total" else ""
            lines.append(_row(_k(n), kind, f"{k['minimum'][kind] / n:,.0f}", f"{k['allocated'][kind] / n:,.0f}", full))
    out["kv_per_token"] = "\n".join(lines)

    lines = [
        _row("context", "minimum", "hkv allocates", "uniform full KV", "full KV / minimum"),
        "|---|---|---|---|---|",
    ]
    for n, k in d["kv"].items():
        lines.append(
            _row(
                _k(n),
                f"{_gb(k['minimum']['total'], 3)} GB",
                f"{_gb(k['allocated']['total'], 3)} GB",
                f"{_gb(k['uniform_full_kv'], 3)} GB",
                f"{k['full_over_minimum']:.2f}x",
            )
        )
    out["kv_per_context"] = "\n".join(lines)

    w = d["weights"]
    lines = [_row("part", "parameters", "bf16 (as hkv loads today)", "release precision"), "|---|---|---|---|"]
    for g in ("routed_experts", "shared_experts", "attention", "router", "embed_head", "other"):
        lines.append(
            _row(g, f"{w['params'][g]:,}", f"{_gb(w['bytes']['bf16'][g])} GB", f"{_gb(w['bytes']['release'][g])} GB")
        )
    lines.append(
        _row(
            "**total**",
            f"**{w['params_total']:,}**",
            f"**{_gb(w['bytes_total']['bf16'])} GB**",
            f"**{_gb(w['bytes_total']['release'])} GB**",
        )
    )
    lines.append(_row("active per token", f"{w['params_active_per_token']:,}", "", ""))
    out["weights"] = "\n".join(lines)

    lines = [
        _row(
            "platform",
            "weights",
            "HBM per device",
            "usable (90%)",
            "weights per device (DP attention + EP)",
            "(even split)",
            "left for cache per device",
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["capacity"]:
        lines.append(
            _row(
                r["platform"],
                r["precision"],
                f"{_gb(r['hbm'], 1)} GB",
                f"{_gb(r['usable'], 1)} GB",
                f"{_gb(r['weights_per_device'], 1)} GB",
                f"{_gb(r['weights_even_split'], 1)} GB",
                f"{_gb(r['cache_per_device'], 1)} GB",
            )
        )
    out["memory"] = "\n".join(lines)

    lines = [
        _row(
            "platform",
            "weights",
            "context",
            "per device",
            "per node / slice",
            "uniform full KV, per node",
            "TP attention (K=V replicated), per node",
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["capacity"]:
        for n, c in r["contexts"].items():
            lines.append(
                _row(
                    r["platform"],
                    r["precision"],
                    _k(n),
                    f"{c['per_device']:,}",
                    f"{c['per_node']:,}",
                    f"{c['uniform_full_kv_per_node']:,}",
                    f"{c['tp_attention_per_node']:,}",
                )
            )
    out["contexts"] = "\n".join(lines)

    lines = [
        _row(
            "prefix",
            "blocks",
            "rows (COMPRESSED + INDEXER)",
            "SWA + TAIL snapshot",
            "hkv restore",
            "uniform full KV",
            "prefixes on one node's NVMe: hkv / full KV",
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["restore"]:
        lines.append(
            _row(
                _k(r["length"]),
                f"{r['blocks']:,}",
                f"{r['rows'] / 2**20:,.1f} MiB",
                f"{r['snapshot'] / 2**20:,.1f} MiB",
                f"{r['total'] / 2**20:,.1f} MiB",
                f"{r['uniform_full_kv'] / 2**20:,.1f} MiB",
                f"{r['node_nvme_prefixes']:,} / {r['node_nvme_prefixes_full_kv']:,}",
            )
        )
    out["restore_bytes"] = "\n".join(lines)

    lines = [
        _row("prefix", *(f"{rate}/s: hkv / full KV" for rate in RESTORE_RATES)),
        "|---|" + "---|" * len(RESTORE_RATES),
    ]
    for r in d["restore"]:
        lines.append(
            _row(_k(r["length"]), *(f"{_gb(v['hkv'])} / {_gb(v['uniform_full_kv'])} GB/s" for v in r["rates"].values()))
        )
    out["restore_bandwidth"] = "\n".join(lines)

    by_len = {r["length"]: r for r in d["restore"]}
    lines = [
        _row("link", "bandwidth", *(f"{_k(n)} restores/s: hkv / full KV" for n in (32 * 1024, 128 * 1024))),
        "|---|---|---|---|",
    ]
    for name, bw in d["links"].items():
        cells = [
            f"{bw / by_len[n]['total']:,.1f} / {bw / by_len[n]['uniform_full_kv']:,.1f}"
            for n in (32 * 1024, 128 * 1024)
        ]
        lines.append(_row(name, f"{bw / GB:,.2f} GB/s", *cells))
    out["links"] = "\n".join(lines)

    f = d["fleet"]
    rows = [
        ("hosts", f"{f['hosts']:,}"),
        ("store (each host's 8 NVMe drives)", f"{f['store_bytes'] / 10**15:,.2f} PB"),
        ("stored block (64 tokens, rows only)", f"{f['block_bytes'] / 1024:,.1f} KiB"),
        ("block keys", f"{f['blocks']:,.0f}"),
        (f"segments of `max_segment_bytes` = {f['max_segment_bytes'] // 2**20} MiB", f"{f['segments']:,.0f}"),
        ("LIST pages per full `refresh` (1,000 keys each)", f"{f['list_pages_per_refresh']:,}"),
        (
            f"LIST requests/s, every host refreshing each {f['refresh_seconds']} s",
            f"{f['list_requests_per_s_all_hosts']:,.0f}",
        ),
        (f"Bloom filter, {BLOOM_FALSE_POSITIVE:.0%} false positives", f"{f['bloom_bits_per_key']:.2f} bits per key"),
        ("Bloom filter, all keys", f"{f['bloom_bytes_total'] / GB:,.1f} GB"),
        ("Bloom filter, one host's share", f"{f['bloom_bytes_per_host'] / 10**6:,.1f} MB"),
    ]
    out["fleet"] = "\n".join([_row("quantity", "value"), "|---|---|"] + [_row(*r) for r in rows])
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the report (or, with --json, every number and the rendered tables as JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args(argv)
    d = compute()
    if args.json:
        print(json.dumps({**d, "tables": tables(d)}, indent=1, default=str))
        return
    m = d["model"]
    print(
        f"DeepSeek-V4-Flash: {m['layers']} layers ({m['csa_layers']} CSA m=4, {m['hca_layers']} HCA m=128), "
        f"K=V head_dim {m['head_dim']}, window {m['window']}; bf16 cache, {m['block_tokens']}-token blocks, "
        f"{m['page_size']}-row pages. Bytes per token:"
    )
    titles = {
        "kv_per_token": "KV state, bytes per token of context",
        "kv_per_context": "KV state of one sequence",
        "weights": "Weights",
        "memory": "Memory per device",
        "contexts": "Contexts that fit",
        "restore_bytes": "Bytes of one restored prefix (what the disk tier reads)",
        "restore_bandwidth": "Store bandwidth for R restores per second (per node)",
        "links": "Restores per second each link allows",
        "fleet": f"The store at {HOSTS:,} hosts",
    }
    for name, table in tables(d).items():
        print(f"\n## {titles[name]}\n\n{table}")


if __name__ == "__main__":
    main()
