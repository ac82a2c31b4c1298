"""DeepSeek-V4's embedding split by vocabulary rows over a mesh's "model" axis (`embed_lookup`): each
device looks up the tokens its rows hold, an all-gather of the looked-up rows (not of the table) hands
every device each token's row, and the rows are the single device's exactly."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.deepseek_v4.model import embed_lookup, tensor_parallel_dim


def test_a_vocab_parallel_lookup_is_the_table_row_and_gathers_only_rows():
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((128, 48)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 128, (3, 7)), jnp.int32)
    assert tensor_parallel_dim("embed", table.shape) == -2 and tensor_parallel_dim("head", table.shape) == -2
    assert tensor_parallel_dim("head.data", (128, 48)) == -2 and tensor_parallel_dim("embed", (128,)) is None
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    split = jax.device_put(table, NamedSharding(mesh, P("model", None)))
    with jax.set_mesh(mesh):
        fn = jax.jit(embed_lookup)
        hlo = fn.lower(split, tokens).compile().as_text()
        got = np.asarray(fn(split, tokens))
    np.testing.assert_array_equal(got, np.asarray(table)[np.asarray(tokens)])
    gathered = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} all-gather\(", hlo)
    assert gathered and all("128" not in g.split(",")[1:] for g in gathered), gathered  # rows, not the table
    assert np.array_equal(np.asarray(embed_lookup(table, tokens)), got)  # no mesh: a plain gather
