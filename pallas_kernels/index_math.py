"""Integer index arithmetic for paged caches, in the fewest HLO ops.

Positions, row counts and page numbers are never negative, but `jnp`'s `//` and `%` on signed
integers follow Python's floor semantics: each adds a sign correction (a sign, a compare, a select),
and XLA's rewrite of a signed division by a power of two adds a negate and a select more. XLA then
copies such an elementwise expression into every fusion that reads its result, so in the compiled
decode step of a hybrid-attention cache these corrections were a fifth of the program (compile time
grows with it). On values known to be >= 0 the same results come from one op (a shift or a mask for
a power of two), and a gather whose indices are already in bounds needs no fill mask.

    div(x, m)        x // m   for integer x >= 0 and a static m > 0
    rem(x, m)        x % m    for integer x >= 0 and a static m > 0
    take_rows(x, i)  x[b, i[b, j]] for x [B, L, ...] and int i[B, J] already in [0, L)

For a power of two m, `div` and `rem` (an arithmetic shift and a mask) equal Python's `//` and `%`
on every integer, negative ones too; for another m they truncate, which equals them on x >= 0 only.
`take_rows` with an index out of range returns some row (XLA clamps gather starts): callers clip
the indices or mask the lanes whose indices are not meaningful.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_divisor(m: int) -> None:
    if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
        raise ValueError(f"divisor m={m!r} must be a Python int >= 1")


def div(x: jax.Array, m: int) -> jax.Array:
    """x // m for an integer array x >= 0 and a static m >= 1, in x's dtype: one shift when m is a
    power of two, else one truncating division (equal to floor division on x >= 0)."""
    _check_divisor(m)
    if m & (m - 1) == 0:
        return jax.lax.shift_right_arithmetic(x, m.bit_length() - 1)
    return jax.lax.div(x, m)


def rem(x: jax.Array, m: int) -> jax.Array:
    """x % m for an integer array x >= 0 and a static m >= 1, in x's dtype: one mask when m is a
    power of two, else one truncating remainder (equal to Python's % on x >= 0)."""
    _check_divisor(m)
    if m & (m - 1) == 0:
        return jax.lax.bitwise_and(x, m - 1)
    return jax.lax.rem(x, m)


def take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] along axis 0 for integer idx with every index in [0, len(x)): one gather, without the
    negative-index wrap of `x[idx]`. An index out of range reads some row (XLA clamps gathers), so
    callers use it where such a row's result is masked away (e.g. an idle batch row's slot)."""
    return x.at[idx].get(mode="promise_in_bounds", wrap_negative_indices=False)


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[b, idx[b, j]] for x [B, L, ...] and integer idx [B, J] with every index in [0, L)
    -> [B, J, ...]: one gather, without the bounds and negative-index handling
    `jnp.take_along_axis` adds by default."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1, mode="promise_in_bounds", wrap_negative_indices=False)


__all__ = ["div", "rem", "take", "take_rows"]
