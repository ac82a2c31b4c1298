"""Operations per decode step: the CPU proxy of kernels per token (issue 46), tracked across commits.

A GPU decode step of the tiny DeepSeek-V4 was launch-bound on the one H200 run (~1,130 kernels per
token, each while-loop iteration a device-to-host test of its condition). Without a device, this
counts what can be counted here, for one decode step (`cached_step`, one token for each of `--batch`
slots) of the tiny and the mid-size DeepSeek-V4 and the tiny Gemma 3:

  CPU      the step compiled for this machine (`numerics.compiler_options()`, as the engine compiles
           it): fusions, library calls (dots, YNNPACK fusions, custom calls), copies, while loops and
           conditionals in the optimized program, every computation counted once (a loop body once,
           however many times it runs; the insides of fusions not at all).
  CUDA     the step lowered for CUDA here with the Pallas GPU kernels (StableHLO, no device needed;
           XLA has not fused it yet): while loops (each iteration a launch per kernel and a condition
           read back to the host without command buffers), conditionals (counting the constant-index
           `case` each `jax.lax.platform_dependent` leaves, which XLA folds away), custom calls
           (the Pallas kernels).

    python benchmarks/step_kernels.py            # tiny and mid DeepSeek-V4, tiny Gemma 3, batch 8 (~1 min)
    python benchmarks/step_kernels.py --quick    # tiny DeepSeek-V4 only (~30 s)
"""

from __future__ import annotations

import argparse
import re
import time

import _machine  # benchmarks/_machine.py (the script's folder is on sys.path)
import jax
import jax.numpy as jnp
from generation import MID

import hkv
from hkv.core import transitions
from hkv.numerics import compiler_options
from models import deepseek_v4, gemma3

T0 = time.perf_counter()


def decode_step(model, batch: int, context: int = 256):
    """(kernel_backend -> the jitted decode step of `model` for `batch` slots, the steps' arguments);
    kernel_backend is the decode attention's (`cached_step`'s option; None: this machine's default)."""
    layout = hkv.CacheLayout(
        model.cache_spec(block_tokens=16),
        hkv.CacheConfig(slots=batch, max_context=context, page_size=16, prefix_records=0),
    )
    cache = hkv.init_cache(layout)
    for _ in range(batch):
        cache, _, _ = transitions.claim_slot(layout, cache)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    slots = jnp.arange(batch, dtype=jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)

    def step_for(kernel_backend: str | None = None):
        def step(cache, tokens, slots, n_valid):
            return model.cached_step(layout, cache, tokens, slots, n_valid, kernel_backend=kernel_backend)

        return jax.jit(step)

    return step_for, (cache, tokens, slots, ones)


def opcode(line: str) -> str | None:
    """The opcode of one instruction line of an HLO module's text (None for other lines)."""
    m = re.match(r"\s*(?:ROOT\s+)?%\S+ = ", line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    op = re.match(r"\s*([\w-]+)\(", rest)
    return op.group(1) if op else None


def cpu_counts(step, args) -> dict[str, int]:
    """Operation counts of the step's optimized CPU program (see the module docstring)."""
    text = step.lower(*args).compile(compiler_options()).as_text()
    counts = {"fusions": 0, "library calls": 0, "copies": 0, "while loops": 0, "conditionals": 0}
    fused = False
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY")) and line.rstrip().endswith("{"):  # a computation's header
            fused = line.startswith(("%fused", "%wrapped", "%parallel"))  # a fusion's inside
        op = opcode(line)
        if op is None or fused:
            continue
        kind = re.search(r"kind=(\w+)", line)
        if op == "fusion":
            counts["library calls" if kind and kind.group(1) == "kCustom" else "fusions"] += 1
        elif op in ("custom-call", "dot"):
            counts["library calls"] += 1
        elif op == "copy":
            counts["copies"] += 1
        elif op == "while":
            counts["while loops"] += 1
        elif op == "conditional":
            counts["conditionals"] += 1
    return counts


def cuda_counts(step, args) -> dict[str, int]:
    """While loops, conditionals and custom calls of the step lowered for CUDA (StableHLO)."""
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return {
        "while loops": text.count("stablehlo.while"),
        "conditionals": text.count("stablehlo.case") + text.count("stablehlo.if"),
        "custom calls": text.count("stablehlo.custom_call"),
    }


def models(quick: bool):
    out = [("DeepSeek-V4 tiny", lambda: deepseek_v4.model.init(deepseek_v4.tiny_config(), 0))]
    if not quick:
        out.append(("DeepSeek-V4 mid", lambda: deepseek_v4.model.init(deepseek_v4.tiny_config(**MID), 0)))
        out.append(("Gemma 3 tiny", lambda: gemma3.init(gemma3.tiny_config(), 0)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny DeepSeek-V4 only")
    ap.add_argument("--batch", type=int, default=8, help="decode slots (default 8)")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch={args.batch} must be >= 1")
    print(f"hkv at {_machine.hkv_revision()}, jax {jax.__version__}, decode step at batch {args.batch}\n")
    print("| model | CPU fusions | CPU library calls | CPU copies | CPU while loops | CPU conditionals "
          "| CUDA while loops | CUDA conditionals | CUDA custom calls |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, build in models(args.quick):
        step_for, step_args = decode_step(build(), args.batch)
        c, g = cpu_counts(step_for(), step_args), cuda_counts(step_for("gpu"), step_args)
        print(f"| {name} | {c['fusions']} | {c['library calls']} | {c['copies']} | {c['while loops']} "
              f"| {c['conditionals']} | {g['while loops']} | {g['conditionals']} | {g['custom calls']} |",
              flush=True)  # fmt: skip
    print(f"\n({time.perf_counter() - T0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
