"""benchmarks/step_kernels.py counts what it says: loops, conditionals and library calls of a compiled
CPU program, and the loops of a program lowered for CUDA (issue 46's CPU proxy of kernels per token)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import hkv

from . import benchmark_script


def load(monkeypatch):
    # benchmarks/generation.py (which step_kernels imports for its mid-size model) sets
    # Engine.decode_while_building for its figures: monkeypatch puts the class attribute back
    monkeypatch.setattr(hkv.Engine, "decode_while_building", hkv.Engine.decode_while_building)
    return benchmark_script.load(monkeypatch, "step_kernels")


def test_a_loop_a_conditional_and_a_product_are_counted(monkeypatch):
    sk = load(monkeypatch)

    def f(x, w):
        y = jax.lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x)
        return jax.lax.cond(y[0, 0] > 0, lambda v: v * 2.0, lambda v: v - 1.0, y)

    step, args = jax.jit(f), (jnp.ones((4, 8)), jnp.ones((8, 8)))
    cpu = sk.cpu_counts(step, args)
    assert cpu["while loops"] == 1 and cpu["conditionals"] == 1 and cpu["library calls"] >= 1
    assert sk.cuda_counts(step, args)["while loops"] == 1
    unrolled = jax.jit(lambda x, w: jax.lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x, unroll=True))
    assert sk.cuda_counts(unrolled, args)["while loops"] == 0


def test_an_instruction_with_a_tuple_shape_is_read(monkeypatch):
    op = load(monkeypatch).opcode
    tuple_shaped = "  %while.5 = (s32[], f32[2,3]{1,0}, /*index=2*/f32[4]) while(%tuple.1), condition=%c, body=%b"
    assert op(tuple_shaped) == "while"
    assert op("  ROOT %fusion.2 = f32[8,8]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%fused_computation") == "fusion"
    assert op("%fused_computation (param_0: f32[8]) -> f32[8] {") is None
