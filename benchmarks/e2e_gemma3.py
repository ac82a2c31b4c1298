"""Gemma 3 end to end against transformers: the same weights served by transformers' eager
`Gemma3ForCausalLM` (its `DynamicCache`) and by `hkv.Engine`, greedy, one prompt at a time: cold
prefill / TTFT, decode ms/token, warm TTFT on a prompt sharing 95% of its tokens, token agreement.
The Gemma 3 counterpart of `benchmarks/e2e.py` (DeepSeek-V4); what both do is `benchmarks/_sidebyside.py`.

    python benchmarks/e2e_gemma3.py --quick          # 1K only (~40 s on 2 quiet cores, ~100 s at load 4)
    python benchmarks/e2e_gemma3.py                  # 1K / 4K / 8K vs transformers, 32K hkv alone (6-8 min quiet)
    python benchmarks/e2e_gemma3.py --contexts 1024,8192 --hkv-only-contexts '' --json /tmp/g3.json
    python benchmarks/e2e_gemma3.py --new-tokens 64  # decode from 7 dispatches of 8 tokens per context, not 1
    python benchmarks/e2e_gemma3.py --contexts 8192 --hkv-only-contexts '' --rounds 3  # medians of 3 alternating rounds

Measuring another tree (hkv is an editable install of the main checkout, so PYTHONPATH must name the
tree measured; the header's "hkv at" line says which tree was imported):

    git worktree add /tmp/w/base <commit>
    PYTHONPATH=/tmp/w/base .venv/bin/python benchmarks/e2e_gemma3.py --quick

Weights: the issue's small Gemma 3 (8 layers, 5 sliding : 1 full, window 128, hidden 256, MLP 1024,
8 query / 2 KV heads of 64, vocab 4096, tied head: `gemma3.tiny_config` with those fields, as
`benchmarks/numerics_cost.py` builds it); `--tiny`: `gemma3.tiny_config()` itself (a smoke run).
Tensors are `gemma3.random_tensors(cfg, --seed)` with matrices x4 (0.08 x N(0,1)) and norm weights x3
(0.3 x N(0,1)), the scales of `tests/models/test_gemma3_parity.py`: at the init's own scale (0.02) 41%
of this model's greedy picks have a top-1/top-2 logit margin under `TIE_MARGIN`, at these 3%. They are
written as one safetensors file (+ config.json) into a temporary folder and both sides load that
folder: transformers with `from_pretrained(attn_implementation="eager", dtype=float32)`, hkv with
`models.gemma3.load(dtype=float32)`; the script checks that every tensor transformers holds equals
the file's. float32 on both sides; torch uses `--torch-threads` threads (2); JAX its default CPU threads.

Per context L (prompt = L random tokens; `--new-tokens` new, 16): as `_sidebyside.run_context` does —
transformers' prefill (one forward, `logits_to_keep=1`) and median one-token decode forward; hkv's tuned
engine (`Engine(block_tokens=64, prefill_chunk=512, prefill_buckets=(64, 128, 256),
RetentionPolicy(every_n_blocks=1))`, one slot, pools for one cached history besides the live one and a
window snapshot at every chunk end, `warmup()` before timing): cold TTFT (`stats()["ttft_seconds"]`),
decode ms/token (the median over its 8-token decode dispatches of step time / tokens), then warm TTFT
of a prompt of the same length whose first 95% of tokens are the cold prompt's. `--defaults` adds an
engine with every setting at its default (`CacheConfig(max_context=M)`). Tokens: each hkv continuation
against transformers' ("x/N" = leading tokens equal); a first difference at a near-tie (hkv's token is
transformers' runner-up and transformers' top-1/top-2 margin < `TIE_MARGIN`) is reported and not
counted, any other makes the script exit 1.

`--hkv-only-contexts` (32768): the tuned engine alone, skipped when its cold prefill extrapolated from
the two largest measured contexts exceeds `--hkv-only-budget` seconds. hkv's decode ms/token is also
printed per context against its decode at the smallest context (the issue's "8K within 2x of 1K").
`--rounds N` (1): N cold-prompt rounds per context, transformers then hkv (prefixes evicted),
alternating; the tables then hold the medians and the details each ratio's range over the rounds (a
drifting shared CPU moves either engine by 15-25% between minutes). `--json PATH` writes every
figure. Progress lines (stderr) carry the 1-minute load average; tables go to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import _sidebyside  # noqa: F401  (benchmarks/_sidebyside.py: sets OMP_WAIT_POLICY=PASSIVE before torch loads)
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from _sidebyside import (
    BLOCK,
    CHUNK,
    SHARED,
    TIE_MARGIN,
    agreeing,
    fmt_s,
    log,
    measured_tree,
    round_ratios,
    run_context,
    run_hkv_only,
    say,
    tree_state,
)
from safetensors.numpy import save_file
from transformers import Gemma3ForCausalLM

from models import gemma3

SMALL = {  # the issue's small Gemma 3 (layer_types from tiny_config's sliding_window_pattern 6: 5 sliding : 1 full)
    "num_hidden_layers": 8,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 128,
    "vocab_size": 4096,
    "max_position_embeddings": 65536,
}
MATRIX_SCALE, NORM_SCALE = 4.0, 3.0  # random_tensors' 0.02 / 0.1 -> 0.08 / 0.3, as the parity tests' weights
TARGETS = {"prefill": 10.0, "decode": 3.0, "warm": 100.0, "decode_growth": 2.0}  # issue 48 at 8K


# ------------------------------------------------------------------------------------ weights
def write_checkpoint(cfg: gemma3.Gemma3Config, seed: int, folder: str) -> dict[str, np.ndarray]:
    """An HF `Gemma3ForCausalLM` checkpoint (model.safetensors + config.json) of random weights in
    `folder`; returns the tensors under their checkpoint names."""
    tensors = {
        "model." + name: (t * (NORM_SCALE if name.endswith("norm.weight") else MATRIX_SCALE)).astype(np.float32)
        for name, t in gemma3.random_tensors(cfg, seed).items()
    }
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    hf_cfg = {**cfg.to_hf(), "architectures": ["Gemma3ForCausalLM"], "dtype": "float32"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    return tensors


def check_same_weights(hf: Gemma3ForCausalLM, tensors: dict[str, np.ndarray]) -> str:
    """Every parameter transformers holds equals the checkpoint's tensor of that name (lm_head: the
    tied embedding); raises SystemExit otherwise."""
    params = dict(hf.named_parameters(remove_duplicate=False))
    bad = []
    for name, p in params.items():
        want = tensors["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        if not np.array_equal(p.detach().numpy(), want):
            bad.append(name)
    missing = sorted(set(tensors) - set(params))
    if bad or missing:
        raise SystemExit(f"transformers' weights differ from the checkpoint: {bad}; not loaded: {missing}")
    return f"{len(tensors)} tensors, identical in transformers"


# ------------------------------------------------------------------------------------ report
def fmt_x(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def tokens_cell(r: dict, key: str, ref: str) -> str:
    got, want = r[key]["tokens"], r[ref]["tokens"]
    cell = f"{agreeing(got, want)}/{len(want)}"
    verdict = r["verdicts"].get(key)
    return cell + (" (near-tie)" if verdict == "near-tie" else " MISMATCH" if verdict == "mismatch" else "")


def report(results: list[dict], done: list[dict], skipped: list[str], args) -> None:
    say(
        "\n## Side by side (transformers / hkv tuned; decode = ms per token after the first, median; "
        "warm x = transformers cold prefill / hkv warm TTFT)\n"
    )
    say(
        "| context | transformers prefill | hkv cold TTFT | x | transformers decode | hkv decode | x "
        "| hkv warm TTFT (95% shared) | warm x | tokens cold, warm |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        h, c, w = r["hf"], r["cold"], r["warm"]
        say(
            f"| {r['ctx']} | {fmt_s(h['prefill'])} | {fmt_s(c['ttft'])} | {fmt_x(h['prefill'] / c['ttft'])} "
            f"| {h['decode_ms']:.1f} ms | {c['decode_ms']:.1f} ms | {fmt_x(h['decode_ms'] / c['decode_ms'])} "
            f"| {fmt_s(w['ttft'])} | {fmt_x(h['prefill'] / w['ttft'])} "
            f"| {tokens_cell(r, 'cold', 'hf')}, {tokens_cell(r, 'warm', 'hf_warm')} |"
        )
    if any("cold_defaults" in r for r in results):
        say("\n## Defaults engine (`CacheConfig(max_context=M)`, everything else default)\n")
        say("| context | cold TTFT | decode | warm TTFT | warm x | restored | tokens cold, warm |")
        say("|---|---|---|---|---|---|---|")
        for r in results:
            if "cold_defaults" in r:
                cd, wd = r["cold_defaults"], r["warm_defaults"]
                say(
                    f"| {r['ctx']} | {fmt_s(cd['ttft'])} | {cd['decode_ms']:.1f} ms | {fmt_s(wd['ttft'])} "
                    f"| {fmt_x(r['hf']['prefill'] / wd['ttft'])} | {wd['restored']} of {r['shared']} "
                    f"| {tokens_cell(r, 'cold_defaults', 'hf')}, {tokens_cell(r, 'warm_defaults', 'hf_warm')} |"
                )

    everything = sorted(results + done, key=lambda r: r["ctx"])
    if everything:
        low = everything[0]
        say(
            f"\n## hkv decode per context (ms per token, median (mean); growth = / at {low['ctx']}; "
            "hkv's median is over its decode dispatches, `decode_steps` = 8 tokens each)\n"
        )
        say("| context | hkv decode | dispatches | growth | transformers decode | growth |")
        say("|---|---|---|---|---|---|")
        for r in everything:
            c = r["cold"]
            hf = r.get("hf")
            hf_cells = (
                f"{hf['decode_ms']:.1f} ({hf['decode_mean_ms']:.1f}) | {hf['decode_ms'] / low['hf']['decode_ms']:.2f}"
                if hf and "hf" in low
                else "- | -"
            )
            say(
                f"| {r['ctx']} | {c['decode_ms']:.1f} ({c['decode_mean_ms']:.1f}) | {c['decode_dispatches']} "
                f"| {c['decode_ms'] / low['cold']['decode_ms']:.2f} | {hf_cells} |"
            )
        few = min(r["cold"]["decode_dispatches"] for r in everything)
        if few < 3:
            say(
                f"\n(hkv's decode figures rest on {few} dispatch{'es' if few != 1 else ''} each: noisy; "
                "--new-tokens 64 gives 7)"
            )

    if done or skipped:
        say("\n## hkv alone\n")
        say("| context | cold TTFT | decode ms/token (mean) | warm TTFT (95% shared) | restored | warm-up (compile) |")
        say("|---|---|---|---|---|---|")
        for r in done:
            c, w = r["cold"], r["warm"]
            say(
                f"| {r['ctx']} | {fmt_s(c['ttft'])} | {c['decode_ms']:.1f} ({c['decode_mean_ms']:.1f}) | "
                f"{fmt_s(w['ttft'])} | {w['restored']} | {r['compile']['wall']:.0f} s ({r['compile']['compile']:.0f}) |"
            )
        for msg in skipped:
            say(f"| {msg} | | | | | |")

    say("\n## Details\n")
    for r in everything:
        w = r["warm"]
        line = (
            f"* {r['ctx']}{'' if 'hf' in r else ' (hkv alone)'}: tuned engine warm-up {r['compile']['wall']:.0f} s "
            f"(compile_seconds {r['compile']['compile']:.0f}, excluded); hkv cold prefill_seconds "
            f"{r['cold']['prefill_seconds']:.2f}; warm prompt shares {r['shared']} tokens, restored {w['restored']}"
            f"{' (window rebuilt)' if w['window_recomputed'] else ''}"
        )
        if "hf_warm" in r:
            line += f"; transformers prefill of the warm prompt {fmt_s(r['hf_warm']['prefill'])} (second sample)"
        compiled = sum(
            r[k]["compiled_in_request"] for k in ("cold", "warm", "cold_defaults", "warm_defaults") if k in r
        )
        if compiled:
            line += f"; {compiled:.1f} s compiled inside timed requests"
        loads = [r[k]["load"] for k in ("hf", "hf_warm", "cold", "warm") if k in r]
        line += f"; load average {min(loads):.1f}-{max(loads):.1f}"
        if round_ratios(r):
            line += f"; {round_ratios(r)}"
        say(line)

    if not results:
        return
    by = {r["ctx"]: r for r in results}
    top, low = max(by), min(by)
    rt = by[top]

    def target(value: float, key: str, at_most: bool = False) -> str:
        ok = value <= TARGETS[key] if at_most else value >= TARGETS[key]
        return f"target {'<=' if at_most else '>='} {TARGETS[key]:g}x: {'met' if ok else 'NOT met'}"

    say(f"\n## Against the issue's targets (at {top})\n")
    p = rt["hf"]["prefill"] / rt["cold"]["ttft"]
    say(f"* cold prefill: transformers / hkv = {fmt_x(p)}x ({target(p, 'prefill')})")
    d = rt["hf"]["decode_ms"] / rt["cold"]["decode_ms"]
    say(f"* decode: transformers / hkv = {d:.1f}x ({target(d, 'decode')})")
    w = rt["hf"]["prefill"] / rt["warm"]["ttft"]
    say(f"* warm TTFT (95% shared), tuned engine: {fmt_x(w)}x below transformers' cold prefill ({target(w, 'warm')})")
    if "warm_defaults" in rt:
        wd = rt["hf"]["prefill"] / rt["warm_defaults"]["ttft"]
        say(f"* warm TTFT, defaults engine: {fmt_x(wd)}x ({target(wd, 'warm')})")
    if low < top:
        g = rt["cold"]["decode_ms"] / by[low]["cold"]["decode_ms"]
        say(
            f"* hkv decode at {top} / at {low} = {g:.2f}x ({target(g, 'decode_growth', at_most=True)}); "
            f"transformers: {rt['hf']['decode_ms'] / by[low]['hf']['decode_ms']:.2f}x"
        )
    checks = sum(r["checks"] for r in results)
    bad = sum(r["mismatches"] for r in results)
    ties = sum(r["ties"] for r in results)
    say(
        f"* tokens: {checks} greedy continuations of {args.new_tokens} tokens: {checks - bad - ties} equal, "
        f"{ties} diverging at a near-tie (margin < {TIE_MARGIN}, not counted), {bad} mismatches "
        f"(target 0: {'met' if bad == 0 else 'NOT met'})"
    )


def to_json(results: list[dict], done: list[dict], skipped: list[str], meta: dict) -> dict:
    def clean(r: dict) -> dict:
        return {
            k: ({kk: (str(vv) if kk == "plan" else vv) for kk, vv in v.items()} if isinstance(v, dict) else v)
            for k, v in r.items()
        }

    return {
        "meta": meta,
        "contexts": [clean(r) for r in results],
        "hkv_only": [clean(r) for r in done],
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,8192", help="contexts run on both transformers and hkv")
    ap.add_argument("--hkv-only-contexts", default="32768", help="contexts run on hkv alone ('' for none)")
    ap.add_argument("--hkv-only-budget", type=float, default=300.0, help="skip an hkv-only context whose "
                    "extrapolated cold prefill exceeds this many seconds")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--defaults", action="store_true", help="also a default-settings engine")
    ap.add_argument("--tiny", action="store_true", help="gemma3.tiny_config() instead of the small model")
    ap.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    ap.add_argument("--quick", action="store_true", help="1K only, no hkv-only context")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="cold-prompt rounds per context, transformers and hkv alternating (medians reported; >= 1)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    if args.quick:
        args.contexts, args.hkv_only_contexts = "1024", ""
    contexts = [int(c) for c in args.contexts.split(",") if c]
    hkv_only = [int(c) for c in args.hkv_only_contexts.split(",") if c]
    torch.set_num_threads(args.torch_threads)

    t_start = time.perf_counter()
    root, rev = measured_tree()
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "machine": f"{_machine.cores()}-core {platform.machine()} {jax.default_backend().upper()}",
        "load_start": os.getloadavg()[0],
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "hkv_tree": root,
        "hkv_revision": rev,
        "hkv_tree_state": tree_state(root),
        "command": f"python benchmarks/e2e_gemma3.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
    }
    say(
        f"date {meta['date']}; machine: {meta['machine']}, load average {meta['load_start']:.2f}; jax "
        f"{jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
        f"{transformers.__version__}; hkv at {rev} ({meta['hkv_tree_state']}) from {root}"
    )
    say(f"command: {meta['command']}")
    cfg = gemma3.tiny_config() if args.tiny else gemma3.tiny_config(**SMALL)
    folder = tempfile.mkdtemp(prefix="hkv-e2e-gemma3-")
    try:
        log(f"random weights (seed {args.seed}) -> {folder}")
        tensors = write_checkpoint(cfg, args.seed, folder)
        hf = Gemma3ForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
        model = gemma3.load(folder, dtype=jnp.float32)
        same = check_same_weights(hf, tensors)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    del tensors
    kinds = [t.split("_")[0] for t in cfg.layer_types]
    say(
        f"model: Gemma 3{' (tiny)' if args.tiny else ''}, {cfg.num_hidden_layers} layers {kinds}, hidden "
        f"{cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_attention_heads} query / "
        f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim}, window {cfg.window}, vocab {cfg.vocab_size}, "
        f"tied head; float32 random weights (seed {args.seed}): {same}; transformers eager, its DynamicCache"
    )
    say(
        f"hkv tuned engine: block {BLOCK}, prefill chunk {CHUNK}, 1 slot, RetentionPolicy(every_n_blocks=1), "
        f"warmup() before timing{'; defaults engine: CacheConfig(max_context=M)' if args.defaults else ''}; "
        f"{args.new_tokens} new tokens; warm prompt = first {SHARED:.0%} of the cold prompt + new tokens"
    )

    rng = np.random.default_rng(args.seed)
    run_options = {"vocab": cfg.vocab_size, "new": args.new_tokens, "defaults": args.defaults, "rounds": args.rounds}
    results = [run_context(ctx, hf, model, rng, with_hf=True, **run_options) for ctx in contexts]
    del hf
    done, skipped = run_hkv_only(hkv_only, results, model, rng, args.hkv_only_budget, run_options)
    report(results, done, skipped, args)
    meta["seconds"] = time.perf_counter() - t_start
    meta["load_end"] = os.getloadavg()[0]
    say(f"\ntotal {meta['seconds']:.0f} s (load average now {meta['load_end']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(results, done, skipped, meta), f, indent=1, default=str)
        log(f"figures -> {args.json}")
    return 1 if sum(r["mismatches"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
