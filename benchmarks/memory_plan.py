"""The memory plan of DeepSeek-V4-Flash and Gemma-3-27B on 8xH200, TPU v5p-16 and v5e-8, read off the
models themselves (`models.memory_plan`): each built with abstract weights sharded as
`hkv.Engine(model, config, mesh=mesh)` shards them, its cache by `jax.eval_shape` — no weights, no
device memory, seconds.

    python benchmarks/memory_plan.py              # the tables of docs/scaling.md ("Memory plan")
    python benchmarks/memory_plan.py --json       # the same numbers as JSON
    python benchmarks/memory_plan.py --compile    # + the decode and prefill steps' temporaries, compiled here

Per device: the weights (each weight's shard in its storage dtype: the release's FP8 / FP4 kept
quantized, or bf16 as `load(dequantize=True)` holds them), and one data shard's cache per slot (64-token
pages, no prefix records); per node: how many contexts of 128K and 1M tokens fit in the device memory
less `RESERVE_FRACTION` (10%), every data shard full. With `--compile` the decode step and a prefill
step of `--chunk` tokens are also lowered with those abstract weights and cache and compiled for this
machine's CPU on 8 host devices, and the larger of their temporaries (`memory_analysis`: the engine
runs one program at a time) counted too: the CPU programs' scratch, not a GPU's or TPU's.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hkv.engine.weight_split import WeightSplit
from models.deepseek_v4 import DeepseekV4, expert_parallel_dim, flash_config, tensor_parallel_dim
from models.deepseek_v4.release import abstract_release_tensors
from models.gemma3 import Gemma3, gemma3_27b_config
from models.gemma3.model import expected_tensors as gemma_tensors
from models.memory_plan import (
    PLATFORMS,
    RESERVE_FRACTION,
    abstract_mesh,
    abstract_model,
    compile_mesh_temporaries,
    compile_temporaries,
    plan,
)

CONTEXTS = (128 * 1024, 1024 * 1024)
GB = 10**9


EVERY_DEVICE = ("data", "model")  # `expert_axes` of the "DP attention + EP" layouts


def models() -> dict:
    """name -> (build(), tensor_parallel_dim or None, layouts ((data, model), expert_axes) to plan)."""
    flash = flash_config()
    gemma = gemma3_27b_config()
    v4_meshes = tuple((m, ()) for m in ((1, 8), (2, 4), (4, 2), (8, 1))) + tuple(
        (m, EVERY_DEVICE) for m in ((8, 1), (4, 2), (2, 4))
    )

    def gemma_build():
        return Gemma3(
            gemma, {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in gemma_tensors(gemma).items()}, jnp.bfloat16
        )

    return {
        "DeepSeek-V4-Flash, release (FP8 + FP4)": (
            lambda: DeepseekV4(flash, abstract_release_tensors(flash), jnp.bfloat16),
            tensor_parallel_dim,
            v4_meshes,
        ),
        "DeepSeek-V4-Flash, bf16": (
            lambda: DeepseekV4(flash, abstract_release_tensors(flash, quantized=False), jnp.bfloat16),
            tensor_parallel_dim,
            v4_meshes,
        ),
        "Gemma-3-27B, bf16": (gemma_build, None, (((8, 1), ()),)),
    }


# the layouts `--compile` lowers (V4-Flash release on 8xH200, 128K)
COMPILED = (((1, 8), ()), ((2, 4), ()), ((8, 1), EVERY_DEVICE))
CHUNK = 4096  # tokens per prefill step `--compile` lowers (`hkv.Engine(prefill_chunk=...)`)


def compute(compile_step: bool = False, chunk: int = CHUNK) -> list[dict]:
    """One row per (model, mesh): per device weights and cache per slot, and per platform the contexts
    of each length one node fits (with `compile_step`, V4-Flash release on 8xH200 at `COMPILED`
    meshes also counts the temporaries of the compiled decode step and of a prefill step of `chunk`
    tokens, the larger of the two: `temp_bytes`, and each: `decode_temp_bytes`, `prefill_temp_bytes`)."""
    rows = []
    for name, (build, dim_of, meshes) in models().items():
        for mesh_shape, expert_axes in meshes:
            experts = {"expert_axes": expert_axes, "expert_dim_of": expert_parallel_dim} if expert_axes else {}
            model = abstract_model(build, abstract_mesh(mesh_shape), "model", dim_of, **experts)
            spec = model.cache_spec(block_tokens=64)
            row = {"model": name, "mesh": list(mesh_shape), "expert_axes": list(expert_axes)}
            row |= {"fits": {}, "temp_bytes": {}, "decode_temp_bytes": {}, "prefill_temp_bytes": {}}
            for platform in PLATFORMS.values():
                for context in CONTEXTS:
                    temps = None
                    release = "release" in name and platform.name == "8xH200" and context == CONTEXTS[0]
                    if compile_step and release and (mesh_shape, expert_axes) in COMPILED:
                        temps = _Temporaries(build, dim_of, mesh_shape, expert_axes, spec, context, chunk)
                    p = plan(model, spec, name, platform, mesh_shape, context, temps)
                    row["weights_bytes"] = p.weights_bytes
                    row[f"cache_per_slot_{context}"] = p.cache_per_slot_bytes
                    row["fits"][f"{platform.name} {context}"] = p.slots_per_node
                    if p.temp_bytes is not None:
                        key = f"{platform.name} {context}"
                        row["temp_bytes"][key] = p.temp_bytes
                        row["decode_temp_bytes"][key] = temps.decode(p.slots_per_shard)
                        row["prefill_temp_bytes"][key] = temps.prefill(p.slots_per_shard)
            rows.append(row)
    return rows


class _Temporaries:
    """slots -> the larger temporaries of the decode step and of a prefill step of `chunk` tokens,
    each compiled once per slot count: of one data shard (a (1, model) mesh of host devices), or,
    with the experts over the data axis too, of the mesh engine's dispatch over the whole mesh."""

    def __init__(self, build, dim_of, mesh_shape, expert_axes, spec, context, chunk):
        self.label, self.context, self.chunk = f"{mesh_shape} {expert_axes or ''}", context, chunk
        if expert_axes:
            mesh = Mesh(np.array(jax.devices()[: mesh_shape[0] * mesh_shape[1]]).reshape(mesh_shape), ("data", "model"))
            model = abstract_model(
                build, mesh, "model", dim_of, expert_axes=expert_axes, expert_dim_of=expert_parallel_dim
            )
            split = WeightSplit(mesh, "model", dim_of, expert_axes, expert_parallel_dim)

            def compile_one(slots: int, chunk: int | None) -> int:
                return compile_mesh_temporaries(model, spec, mesh, split, slots, context, chunk)
        else:
            sub = (1, mesh_shape[1])
            mesh = Mesh(np.array(jax.devices()[: sub[1]]).reshape(sub), ("data", "model"))
            model = abstract_model(build, mesh, "model", dim_of)

            def compile_one(slots: int, chunk: int | None) -> int:
                return compile_temporaries(model, spec, mesh, slots, context, chunk)

        self.compile_one = compile_one
        self.known: dict[tuple[int, int | None], int] = {}

    def _get(self, slots: int, chunk: int | None) -> int:
        if (slots, chunk) not in self.known:
            t = time.perf_counter()
            self.known[slots, chunk] = self.compile_one(slots, chunk)
            what = "decode" if chunk is None else f"prefill of {chunk} tokens"
            took = time.perf_counter() - t
            print(f"  compiled {self.label} {what}, {slots} slots x {self.context} tokens: "
                  f"{self.known[slots, chunk] / GB:.1f} GB temporaries ({took:.0f} s)", flush=True)  # fmt: skip
        return self.known[slots, chunk]

    def decode(self, slots: int) -> int:
        return self._get(slots, None)

    def prefill(self, slots: int) -> int:
        return self._get(slots, self.chunk)

    def __call__(self, slots: int) -> int:
        return max(self.decode(slots), self.prefill(slots))


def _tokens(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}K"


def _gb(b: float) -> str:
    return f"{b / GB:,.1f} GB"


def table(rows: list[dict]) -> str:
    """The doc's table: a row per (model, mesh), per platform the 128K / 1M contexts a node holds."""
    k, m = CONTEXTS
    names = list(PLATFORMS)
    out = [
        "| model | mesh (data, model) | weights / device | cache / slot, 128K | cache / slot, 1M | "
        + " | ".join(f"{n}: 128K / 1M contexts" for n in names)
        + " |",
        "|" + "---|" * (5 + len(names)),
    ]
    for r in rows:
        fits = " | ".join(f"{r['fits'][f'{n} {k}']:,} / {r['fits'][f'{n} {m}']:,}" for n in names)
        out.append(
            f"| {r['model']} | {_mesh(r)} | {_gb(r['weights_bytes'])} "
            f"| {_gb(r[f'cache_per_slot_{k}'])} | {_gb(r[f'cache_per_slot_{m}'])} | {fits} |"
        )
    return "\n".join(out)


def _mesh(row: dict) -> str:
    """The mesh column: (8, 1), or (8, 1), EP over all where the experts are split over every device."""
    shape = f"({row['mesh'][0]}, {row['mesh'][1]})"
    return shape + ", EP over all" if row["expert_axes"] else shape


def largest(rows: list[dict]) -> list[str]:
    """Per platform and context, the most contexts any planned (model, mesh) fits on one node."""
    out = []
    for name in PLATFORMS:
        for context in CONTEXTS:
            best = max(rows, key=lambda r: r["fits"][f"{name} {context}"])
            n = best["fits"][f"{name} {context}"]
            where = f"{best['model']}, mesh {_mesh(best)}" if n else "nothing planned fits"
            out.append(f"* {name}, {_tokens(context)} tokens: {n:,} contexts per node ({where})")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="the numbers as JSON")
    ap.add_argument("--compile", action="store_true", help="also count the compiled steps' temporaries")
    ap.add_argument("--chunk", type=int, default=CHUNK, help=f"tokens per compiled prefill step (default {CHUNK})")
    args = ap.parse_args(argv)
    if args.chunk < 1:
        ap.error(f"--chunk={args.chunk} must be at least 1")
    rows = compute(args.compile, args.chunk)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"Reserve: {RESERVE_FRACTION:.0%} of each device's memory. Platforms: " + "; ".join(
        f"{p.name}: {p.source}" for p in PLATFORMS.values()))  # fmt: skip
    print()
    print(table(rows))
    print()
    print("\n".join(largest(rows)))
    if args.compile:
        print(f"\nWith the temporaries (CPU programs, compiled here; prefill steps of {args.chunk} tokens), 8xH200:")
        for r in rows:
            for key, temp in r["temp_bytes"].items():
                context = int(key.split()[1])
                print(
                    f"  {r['model']} {_mesh(r)} {_tokens(context)}: {r['fits'][key]:,} contexts / node, "
                    f"temporaries {_gb(temp)} / device (decode {_gb(r['decode_temp_bytes'][key])}, "
                    f"prefill {_gb(r['prefill_temp_bytes'][key])})"
                )


if __name__ == "__main__":
    main()
