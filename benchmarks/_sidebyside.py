"""What the side-by-side benchmarks against transformers share (`e2e.py` for DeepSeek-V4,
`e2e_gemma3.py` for Gemma 3): one prompt at a time, greedy, the same weights in transformers' eager
model and in `hkv.Engine`.

* transformers: `hf_generate` times the prefill (one forward of the prompt, `use_cache=True,
  logits_to_keep=1`) and each one-token forward on its cache (decode ms/token = their median).
* hkv: `hkv_engine` builds an engine and compiles every step first (`warmup()`, compile seconds
  reported apart); `hkv_request` drives one request with `submit` + `step()` and reads its TTFT from
  `stats()["ttft_seconds"]`, decode ms/token = the median over the steps that only decoded of step
  time / tokens it produced. `tuned_config` sizes the tuned engine's pools (one slot + one cached
  history + a window snapshot at every chunk end).
* `run_context`: per context L, the cold prompt (L random tokens) and a warm prompt sharing its first
  `SHARED` of tokens, on transformers and on hkv's tuned engine (and optionally its defaults engine);
  `compare_tokens` checks every hkv continuation against transformers' (near-ties reported, not counted).
  With `rounds` > 1, `more_rounds` repeats the cold prompt on both, alternating, and keeps medians.

Importing this module sets `OMP_WAIT_POLICY=PASSIVE` (unless set) before torch loads: import it before torch.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import time

# Before torch loads: idle OpenMP threads sleep instead of spinning. On a shared CPU the default
# (spin) made transformers' 2-thread decode 20-60x slower (threads spin at barriers while their partner
# waits for a core); PASSIVE keeps its figures close to a quiet machine's. Set it yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import _machine  # benchmarks/_machine.py (the importer's folder is on sys.path)
import numpy as np
import torch

import hkv

BLOCK, CHUNK = 64, 512  # the tuned engine
BUCKETS = (64, 128, 256)  # its narrower widths for a prompt's last prefill step (a warm suffix)
SHARED = 0.95  # share of the warm prompt taken from the cold prompt
TIE_MARGIN = 0.05  # transformers top-1/top-2 logit margin below which a first difference counts as a near-tie


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def tree_state(root: str | None = None) -> str:
    """Whether the hkv / models sources under `root` (default: this checkout) differ from its commit."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--", "hkv", "models"],
            capture_output=True,
            text=True,
            check=False,
            cwd=root,
        ).stdout.split("\n")
    except OSError:
        return "git status unavailable"
    files = [line[3:] for line in out if line.strip()]
    return "clean" if not files else f"plus uncommitted changes in {', '.join(files)}"


def measured_tree() -> tuple[str, str]:
    """(folder, short revision) of the tree whose `hkv` this process imported: with
    `PYTHONPATH=/tmp/w/base`, that worktree rather than the checkout the script lives in."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(hkv.__file__)))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, cwd=root
        ).stdout.strip()
    except OSError:
        rev = ""
    return root, rev or "?"


# ------------------------------------------------------------------------------------ transformers
def hf_generate(model, prompt: list[int], new: int) -> dict:
    """Greedy with transformers' cache: timed prefill (first token) and per-token decode forwards."""
    toks, margins, runners = [], [], []

    def pick(logits: torch.Tensor) -> int:
        top = torch.topk(logits[0, -1].float(), 2)
        margins.append(float(top.values[0] - top.values[1]))
        runners.append(int(top.indices[1]))
        return int(top.indices[0])

    with torch.inference_mode():
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        toks.append(pick(out.logits))
        prefill = time.perf_counter() - t0
        cache = out.cache
        t0 = time.perf_counter()
        steps = []
        for _ in range(new - 1):
            ts = time.perf_counter()
            out = model(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
            cache = out.cache
            toks.append(pick(out.logits))
            steps.append(time.perf_counter() - ts)
        decode = time.perf_counter() - t0
    return {
        "tokens": toks,
        "margins": margins,
        "runners": runners,
        "prefill": prefill,
        "decode_ms": 1e3 * float(np.median(steps)) if steps else float("nan"),
        "decode_mean_ms": 1e3 * decode / max(new - 1, 1),
        "load": os.getloadavg()[0],
    }


# ------------------------------------------------------------------------------------ hkv
def tuned_config(model, max_context: int) -> hkv.CacheConfig:
    """One slot; pools: the live slot + one full cached history (+2 pages for copy-on-write) in the
    groups that keep every row (compressed groups; a full-attention layer's window-less SWA group),
    and the slot's window + one snapshot per chunk end (+4) in the windowed SWA groups."""
    spec = model.cache_spec(block_tokens=BLOCK)
    base = hkv.CacheLayout(spec, hkv.CacheConfig(slots=1, max_context=max_context, prefix_records=0))
    pools = []
    for g, grp in enumerate(base.groups):
        if grp.kind == hkv.ObjectKind.SWA and grp.keep is not None:
            per = -(-grp.keep // base.page_size) + 1
            pools.append(base.pool_pages(g) + per * (max_context // CHUNK + 4))
        else:
            pools.append(2 * base.pool_pages(g) + 2)
    return hkv.CacheConfig(
        slots=1, max_context=max_context, pool_pages=tuple(pools), prefix_records=2 * (max_context // BLOCK) + 8
    )


def defaults_config(max_context: int) -> hkv.CacheConfig:
    return hkv.CacheConfig(max_context=max_context)


def tuned_engine_options() -> dict:
    """The tuned engine's keyword arguments besides its config."""
    return {
        "block_tokens": BLOCK,
        "prefill_chunk": CHUNK,
        "prefill_buckets": BUCKETS,
        "retention": hkv.RetentionPolicy(every_n_blocks=1),
    }


def hkv_request(engine: hkv.Engine, prompt: list[int], new: int) -> dict:
    """One request, driven with `submit` + `step()` so each decode dispatch is timed on its own."""
    before = engine.stats()
    t0 = time.perf_counter()
    h = engine.submit(prompt, new)
    per_token = _machine.step_until_done(engine, h)  # seconds per token of each step that only decoded
    wall = time.perf_counter() - t0
    g = h.result()
    after = engine.stats()
    ttft = after["ttft_seconds"][-1]
    compiled = after["compile_seconds"] - before["compile_seconds"]
    if compiled > 0:
        log(f"  note: {compiled:.1f} s of compilation inside this timed request")
    p = g.plan
    return {
        "tokens": list(g.tokens),
        "ttft": ttft,
        "wall": wall,
        "decode_ms": 1e3 * float(np.median(per_token)) if per_token else float("nan"),
        "decode_mean_ms": 1e3 * (wall - ttft) / max(new - 1, 1),
        "decode_dispatches": len(per_token),
        "prefill_seconds": after["prefill_seconds"] - before["prefill_seconds"],
        "compiled_in_request": compiled,
        "restored": 0 if p is None else int(p.restored_tokens),
        "window_recomputed": bool(p is not None and getattr(p, "window_recomputed", False)),
        "plan": p,
        "load": os.getloadavg()[0],
    }


def hkv_engine(model, config: hkv.CacheConfig, label: str, model_id: str = "e2e-random", **kw) -> tuple:
    """An engine with every step compiled (`warmup()`; no persistent compilation cache, so the
    compile figures are real compilations). Returns it and {"wall": warm-up seconds, "compile":
    stats()["compile_seconds"] (summed over the parallel compile threads)}."""
    t0 = time.perf_counter()
    engine = hkv.Engine(model, config, model_id=model_id, compilation_cache=False, **kw)
    engine.warmup()
    out = {"wall": time.perf_counter() - t0, "compile": engine.stats()["compile_seconds"]}
    log(f"  hkv {label}: warmup {out['wall']:.1f} s wall, compile_seconds {out['compile']:.1f} ({config})")
    return engine, out


def release_programs() -> None:
    """Free the compiled programs of engines no longer referenced before the next engine compiles its
    own: XLA's CPU code maps memory regions per program, and a process holding every program of the
    runs (each context's engines compile one prefill per width and read size) passed Linux's
    vm.max_map_count (65,530) and aborted inside LLVM ("Cannot allocate memory") at 8K."""
    gc.collect()
    hkv.engine.compiled.clear()


def prompts_for(ctx: int, vocab: int, rng) -> tuple[list[int], list[int], int]:
    """(cold prompt, warm prompt, shared tokens): `ctx` random tokens, and the same length whose first
    `SHARED` of tokens are the cold prompt's and the rest new random tokens."""
    cold = rng.integers(0, vocab, ctx).tolist()
    shared = int(SHARED * ctx)
    warm = cold[:shared] + rng.integers(0, vocab, ctx - shared).tolist()
    return cold, warm, shared


def agreeing(got: list[int], want: list[int]) -> int:
    """How many leading tokens of `got` equal `want`'s."""
    return next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))


def compare_tokens(label: str, got: list[int], ref: dict) -> str:
    """Compare one hkv continuation with transformers' (`hf_generate`'s dict): "equal", "near-tie" (the
    first difference is transformers' runner-up with a top-1/top-2 margin below TIE_MARGIN; later
    tokens follow different prefixes) or "mismatch". Differences are logged."""
    want, margins, runners = ref["tokens"], ref["margins"], ref["runners"]
    if got == want:
        return "equal"
    i = agreeing(got, want)
    if i < len(got) and i < len(want) and got[i] == runners[i] and margins[i] < TIE_MARGIN:
        log(
            f"  near-tie {label}: first difference at step {i}: hkv {got[i]} = transformers' runner-up, "
            f"transformers' top-1/top-2 margin {margins[i]:.3g} < {TIE_MARGIN} (not counted)"
        )
        return "near-tie"
    log(
        f"  MISMATCH {label}: first difference at step {i} (hkv {got[i] if i < len(got) else None}, transformers "
        f"{want[i] if i < len(want) else None}, transformers' runner-up {runners[i] if i < len(runners) else None}, "
        f"top-1/top-2 margin {margins[i] if i < len(margins) else float('nan'):.3g})"
    )
    log(f"    hkv          {got}")
    log(f"    transformers {want}")
    return "mismatch"


def run_context(
    ctx: int, hf, model, rng, *, vocab: int, new: int, with_hf: bool, defaults: bool, rounds: int = 1
) -> dict:
    """One context: transformers (when `with_hf`) on the cold and warm prompts, hkv's tuned engine
    (fresh, warmed up) on both, then with `defaults` (and `with_hf`) a defaults engine on both; every
    hkv continuation compared with transformers'. Keys: hf, hf_warm, cold, warm, compile,
    cold_defaults, warm_defaults, compile_defaults, verdicts ({hkv key: compare_tokens' verdict}),
    checks, mismatches, ties; with `rounds` > 1 also "rounds" (see `more_rounds`): hf and cold then
    hold the medians of every round's cold prefill / TTFT and decode."""
    cold, warm, shared = prompts_for(ctx, vocab, rng)
    max_context = -(-(ctx + new) // BLOCK) * BLOCK
    r: dict = {"ctx": ctx, "shared": shared, "mismatches": 0, "ties": 0, "checks": 0, "verdicts": {}}
    if with_hf:
        log(f"{ctx}: transformers cold prompt ...")
        r["hf"] = hf_generate(hf, cold, new)
        h = r["hf"]
        log(
            f"  transformers prefill {h['prefill']:.2f} s, decode {h['decode_ms']:.1f} ms/token (median; mean "
            f"{h['decode_mean_ms']:.1f})"
        )
        log(f"{ctx}: transformers warm prompt (reference tokens) ...")
        r["hf_warm"] = hf_generate(hf, warm, new)
        log(f"  transformers prefill {r['hf_warm']['prefill']:.2f} s (second sample)")

    engine, compile_s = hkv_engine(model, tuned_config(model, max_context), f"tuned {ctx}", **tuned_engine_options())
    r["compile"] = compile_s
    r["cold"] = hkv_request(engine, cold, new)
    c = r["cold"]
    log(
        f"  hkv tuned cold: TTFT {c['ttft']:.2f} s, decode {c['decode_ms']:.1f} ms/token "
        f"(median; mean {c['decode_mean_ms']:.1f})"
    )
    r["warm"] = hkv_request(engine, warm, new)
    log(f"  hkv tuned warm: TTFT {r['warm']['ttft']:.3f} s, plan {r['warm']['plan']}")
    if rounds > 1:
        more_rounds(r, rounds, hf if with_hf else None, engine, cold, new)
    del engine
    release_programs()
    if with_hf and defaults:
        engine, r["compile_defaults"] = hkv_engine(model, defaults_config(max_context), f"defaults {ctx}")
        r["cold_defaults"] = hkv_request(engine, cold, new)
        log(f"  hkv defaults cold: TTFT {r['cold_defaults']['ttft']:.2f} s")
        r["warm_defaults"] = hkv_request(engine, warm, new)
        log(f"  hkv defaults warm: TTFT {r['warm_defaults']['ttft']:.3f} s, plan {r['warm_defaults']['plan']}")
        del engine
        release_programs()
    if with_hf:
        pairs = [("cold", "hf"), ("warm", "hf_warm"), ("cold_defaults", "hf"), ("warm_defaults", "hf_warm")]
        for ours, ref in pairs:
            if ours in r:
                r["checks"] += 1
                verdict = compare_tokens(f"{ctx} {ours}", r[ours]["tokens"], r[ref])
                r["verdicts"][ours] = verdict
                r["mismatches"] += verdict == "mismatch"
                r["ties"] += verdict == "near-tie"
    return r


def more_rounds(r: dict, rounds: int, hf, engine: hkv.Engine, cold: list[int], new: int) -> None:
    """Rounds 2..`rounds` of the cold prompt, transformers (when `hf`) then hkv (prefixes evicted
    first, so the request is cold again), alternating so that both meet the same minutes of a
    drifting machine. Adds r["rounds"] = {"hf_prefill", "hf_decode_ms", "ttft", "decode_ms": one
    figure per round}, and replaces r["hf"] / r["cold"]'s prefill, TTFT and decode ms with the
    medians over the rounds; every round's hkv tokens must equal the first round's."""
    per = {"hf_prefill": [], "hf_decode_ms": [], "ttft": [r["cold"]["ttft"]], "decode_ms": [r["cold"]["decode_ms"]]}
    if hf is not None:
        per["hf_prefill"].append(r["hf"]["prefill"])
        per["hf_decode_ms"].append(r["hf"]["decode_ms"])
    for k in range(2, rounds + 1):
        hf_part = ""
        if hf is not None:
            h = hf_generate(hf, cold, new)
            per["hf_prefill"].append(h["prefill"])
            per["hf_decode_ms"].append(h["decode_ms"])
            hf_part = f"transformers {h['prefill']:.2f} s / {h['decode_ms']:.1f} ms, "
        engine.evict_prefixes()
        c = hkv_request(engine, cold, new)
        if c["tokens"] != r["cold"]["tokens"]:
            raise SystemExit(f"hkv's tokens changed between rounds 1 and {k} at {r['ctx']}: {c['tokens']}")
        per["ttft"].append(c["ttft"])
        per["decode_ms"].append(c["decode_ms"])
        log(f"  round {k}: {hf_part}hkv {c['ttft']:.2f} s / {c['decode_ms']:.1f} ms")
    r["rounds"] = per
    if hf is not None:
        r["hf"]["prefill"] = float(np.median(per["hf_prefill"]))
        r["hf"]["decode_ms"] = float(np.median(per["hf_decode_ms"]))
    r["cold"]["ttft"] = float(np.median(per["ttft"]))
    r["cold"]["decode_ms"] = float(np.median(per["decode_ms"]))


def round_ratios(r: dict) -> str:
    """'prefill x a-b, decode x c-d over N rounds' (per-round transformers / hkv), or '' for one round."""
    per = r.get("rounds")
    if not per or not per["hf_prefill"]:
        return ""
    p = [h / t for h, t in zip(per["hf_prefill"], per["ttft"], strict=True)]
    d = [h / t for h, t in zip(per["hf_decode_ms"], per["decode_ms"], strict=True)]
    return (
        f"over {len(p)} alternating rounds (medians in the tables): prefill x {min(p):.1f}-{max(p):.1f}, "
        f"decode x {min(d):.1f}-{max(d):.1f}"
    )


def extrapolate(results: list[dict], ctx: int) -> float | None:
    """Cold prefill seconds at ctx from the two largest measured contexts (power law)."""
    pts = sorted((r["ctx"], r["cold"]["ttft"]) for r in results)[-2:]
    if len(pts) < 2:
        return None if not pts else pts[0][1] * (ctx / pts[0][0]) ** 2
    (c0, t0), (c1, t1) = pts
    k = math.log(t1 / t0) / math.log(c1 / c0)
    return t1 * (ctx / c1) ** k


def run_hkv_only(contexts, results: list[dict], model, rng, budget: float, run_options: dict) -> tuple[list, list]:
    """hkv alone at each of `contexts` (`run_context` without transformers), skipping a context whose
    cold prefill, extrapolated from everything measured so far, exceeds `budget` seconds. Returns
    (the contexts' results, the skip messages)."""
    done, skipped = [], []
    for ctx in contexts:
        est = extrapolate(results + done, ctx)
        if est is not None and est > budget:
            msg = (
                f"{ctx} (hkv only): skipped, cold prefill extrapolated to {est:.0f} s > --hkv-only-budget {budget:.0f}"
            )
            log(msg)
            skipped.append(msg)
            continue
        log(f"{ctx}: hkv only (cold prefill extrapolated to {est:.0f} s)" if est else f"{ctx}: hkv only")
        done.append(run_context(ctx, None, model, rng, with_hf=False, **run_options))
    return done, skipped


def fmt_s(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{1e3 * s:.0f} ms"
