"""The XLA options of the numerical contract (`pallas_kernels.numerics`), in a module of their own so
that `numerics` and `matmul_rows` (whose probe programs need them) both import them."""

from __future__ import annotations

import jax

_CPU_OPTIONS = {
    # YNNPACK's consistent-arithmetic mode: one order per element whatever kernel the shape selects
    "xla_cpu_enable_platform_dependent_math": False,
    # YNNPACK for dots only: elementwise ops and reductions stay in XLA's own emitters, which do not
    # change with the fusion a shape ends up in (and its reductions are 30-70x faster on CPU)
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    # XLA's classic CPU emitters: the newer fusion emitters contract a * b + c into one FMA or not
    # depending on the fusion an expression lands in, so the same float32 arithmetic rounded
    # differently in two programs (a value computed for a program output vs. fused into a consumer)
    "xla_cpu_use_fusion_emitters": False,
    # bfloat16 arithmetic rounds after every op, as written (no float32 carried through a fusion)
    "xla_allow_excess_precision": False,
}


def compiler_options(platform: str | None = None) -> dict[str, object] | None:
    """XLA options every program using this module is compiled with (`jax.jit(..., compiler_options=)`).

    platform: "cpu", "gpu", "tpu" or None (`jax.default_backend()`). Returns None where no option is
    needed (not CPU)."""
    platform = platform or jax.default_backend()
    return dict(_CPU_OPTIONS) if platform == "cpu" else None
