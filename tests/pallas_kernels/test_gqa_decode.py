"""GQA decode attention: kernels (interpreted) and the jnp reference vs an independent float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import testing
from pallas_kernels.gqa_decode import gqa_decode_attention, gqa_decode_attention_reference

HEADS, HEAD_DIM, PAGE_SIZE, WINDOW, PAGES_PER_SEQ, NUM_PAGES = 8, 16, 4, 7, 6, 40
# Empty slot, first token, shorter than the window, window straddling two and three pages, full
# capacity (24 = PAGES_PER_SEQ * PAGE_SIZE).
LENGTHS = np.array([0, 1, 5, 10, 13, 24], np.int32)
BACKENDS = list(testing.KERNEL_BACKENDS)


def oracle_np(q, dense, lengths, sinks, *, num_kv_heads, window, scale, softcap, shared_kv):
    """float64, per sequence and head, straight from the dense logical rows [batch, positions, row]."""
    batch, heads, head_dim = q.shape
    group = heads // num_kv_heads
    out = np.zeros((batch, heads, head_dim))
    for b in range(batch):
        t = int(lengths[b]) - 1
        lo = 0 if window is None else max(t - window + 1, 0)
        rows = dense[b, lo : t + 1].astype(np.float64)  # positions lo..t
        for h in range(heads):
            g = h // group
            k = rows[:, g * head_dim : (g + 1) * head_dim]
            v_col = g if shared_kv else num_kv_heads + g
            v = rows[:, v_col * head_dim : (v_col + 1) * head_dim]
            logits = list(k @ q[b, h].astype(np.float64) * scale)
            if softcap is not None:
                logits = [softcap * np.tanh(x / softcap) for x in logits]
            if sinks is not None:
                logits.append(float(sinks[h]))
            if not logits:
                continue  # empty slot, no sink: zeros
            logits = np.array(logits)
            weights = np.exp(logits - logits.max())
            weights /= weights.sum()
            out[b, h] = weights[: len(rows)] @ v if len(rows) else 0.0
    return out


def make_case(seed, dtype, *, num_kv_heads, window, shared_kv=False, with_sinks=True, softcap=None, scale=None):
    """Random q, sinks and a randomly paged pool; rows a query must not see (before the window) are NaN
    and their wholly-unseen pages unallocated (-1). Returns (jnp args, kwargs, f64 oracle)."""
    rng = np.random.default_rng(seed)
    batch = len(LENGTHS)
    row = (1 if shared_kv else 2) * num_kv_heads * HEAD_DIM
    dense = rng.standard_normal((batch, PAGES_PER_SEQ * PAGE_SIZE, row)).astype(dtype)
    q = rng.standard_normal((batch, HEADS, HEAD_DIM)).astype(dtype)
    sinks = (rng.standard_normal(HEADS) * 2).astype(np.float32) if with_sinks else None
    kw = dict(num_kv_heads=num_kv_heads, window=window, scale=scale, softcap=softcap, shared_kv=shared_kv)
    oracle = oracle_np(q, dense, LENGTHS, sinks, **{**kw, "scale": HEAD_DIM**-0.5 if scale is None else scale})
    starts = np.maximum(LENGTHS - (window or 10**9), 0)
    poisoned = dense.copy()
    for b in range(batch):
        poisoned[b, : starts[b]] = np.nan
    pool, table = testing.page_rows(
        poisoned,
        LENGTHS,
        page_size=PAGE_SIZE,
        pages_per_seq=PAGES_PER_SEQ,
        num_pages=NUM_PAGES,
        rng=rng,
        keep=lambda b, lp: (lp + 1) * PAGE_SIZE > starts[b],
    )
    args = (jnp.asarray(q), jnp.asarray(pool), jnp.asarray(table), jnp.asarray(LENGTHS))
    return args + (None if sinks is None else jnp.asarray(sinks),), kw, oracle


CASES = {
    "window_gqa_f32": dict(dtype=np.float32, num_kv_heads=2, window=WINDOW),
    "full_gqa_bf16": dict(dtype=jnp.bfloat16, num_kv_heads=2, window=None),
    "full_mqa_softcap_nosinks_f32": dict(
        dtype=np.float32, num_kv_heads=1, window=None, softcap=2.0, with_sinks=False, scale=0.5
    ),
    "window_mqa_bf16": dict(dtype=jnp.bfloat16, num_kv_heads=1, window=WINDOW),
    "window_shared_kv_softcap_bf16": dict(
        dtype=jnp.bfloat16, num_kv_heads=2, window=WINDOW, shared_kv=True, softcap=3.0
    ),
    "full_shared_kv_f32": dict(dtype=np.float32, num_kv_heads=4, window=None, shared_kv=True, with_sinks=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_oracle(name):
    case = dict(CASES[name])
    dtype = case.pop("dtype")
    args, kw, oracle = make_case(0, dtype, **case)
    out = gqa_decode_attention_reference(*args, **kw)
    assert out.shape == (len(LENGTHS), HEADS, HEAD_DIM) and out.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), oracle, **testing.tolerance(dtype))
    # The public function with backend="reference" runs the reference (on a GPU or TPU the auto
    # backend is the Pallas kernel, compared within tolerance below). Bit for bit on CPU; on a GPU the
    # jitted public function and the op-by-op reference fuse differently (1 ulp apart, seen on an H200).
    got = np.asarray(gqa_decode_attention(*args, **kw, backend="reference"))
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, np.asarray(out))
    else:
        np.testing.assert_allclose(
            got.astype(np.float32), np.asarray(out.astype(jnp.float32)), **testing.tolerance(dtype)
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_oracle(backend, name):
    case = dict(CASES[name])
    dtype = case.pop("dtype")
    args, kw, oracle = make_case(1, dtype, **case)
    assert np.isnan(np.asarray(args[1], np.float32)).any() or kw["window"] is None  # poison really there
    out = gqa_decode_attention(*args, **kw, backend=backend, interpret=testing.INTERPRET)
    assert out.shape == (len(LENGTHS), HEADS, HEAD_DIM) and out.dtype == jnp.dtype(dtype)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle, **testing.tolerance(dtype))
    if args[4] is None:
        np.testing.assert_array_equal(out[LENGTHS == 0], 0.0)  # an empty slot gets zeros, not NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_page_table_for_the_window(backend):
    args, kw, oracle = make_case(2, np.float32, num_kv_heads=2, window=WINDOW)
    q, pool, table, lengths, sinks = args
    ring = -(-(WINDOW - 1) // PAGE_SIZE) + 1  # the minimum the public function accepts
    ring_table = jnp.asarray(testing.ring_page_table(np.asarray(table), LENGTHS, page_size=PAGE_SIZE, ring=ring))
    out = gqa_decode_attention(q, pool, ring_table, lengths, sinks, **kw, backend=backend, interpret=testing.INTERPRET)
    np.testing.assert_allclose(np.asarray(out), oracle, **testing.tolerance(np.float32))


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_full_attention_past_the_table_sees_its_last_capacity_positions(backend):
    # 3 pages per sequence written as a ring of 12 rows (position p at row p % 12, overwritten in
    # place): full attention attends to the last 12 positions, all that the ring holds.
    rng = np.random.default_rng(3)
    ring_rows, num_kv_heads = 3 * PAGE_SIZE, 2
    dense = rng.standard_normal((len(LENGTHS), PAGES_PER_SEQ * PAGE_SIZE, 2 * num_kv_heads * HEAD_DIM))
    dense = dense.astype(np.float32)
    pool = np.full((NUM_PAGES, PAGE_SIZE, dense.shape[2]), np.nan, np.float32)
    table = rng.permutation(NUM_PAGES)[: 3 * len(LENGTHS)].reshape(len(LENGTHS), 3).astype(np.int32)
    for b, length in enumerate(LENGTHS):
        for p in range(length):
            pool[table[b, (p // PAGE_SIZE) % 3], p % PAGE_SIZE] = dense[b, p]
    q = rng.standard_normal((len(LENGTHS), HEADS, HEAD_DIM)).astype(np.float32)
    sinks = rng.standard_normal(HEADS).astype(np.float32)
    kw = dict(num_kv_heads=num_kv_heads, scale=HEAD_DIM**-0.5, softcap=None, shared_kv=False)
    oracle = oracle_np(q, dense, LENGTHS, sinks, window=ring_rows, **kw)
    out = gqa_decode_attention(
        *map(jnp.asarray, (q, pool, table, LENGTHS, sinks)), **kw, backend=backend, interpret=testing.INTERPRET
    )
    np.testing.assert_allclose(np.asarray(out), oracle, **testing.tolerance(np.float32))


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_stacked_pool_with_traced_layer(backend):
    args, kw, oracle = make_case(4, np.float32, num_kv_heads=2, window=WINDOW)
    q, pool, table, lengths, sinks = args
    stacked = jnp.stack([jnp.full_like(pool, jnp.nan), pool, jnp.full_like(pool, jnp.nan)])

    @jax.jit
    def run(layer):
        return gqa_decode_attention(
            q, stacked, table, lengths, sinks, **kw, layer=layer, backend=backend, interpret=testing.INTERPRET
        )

    out = np.asarray(run(jnp.int32(1)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle, **testing.tolerance(np.float32))


def test_sinks_and_softcap_change_the_result():
    # Guards against a kernel that ignores sinks or softcap.
    args, kw, _ = make_case(5, np.float32, num_kv_heads=2, window=None)
    q, pool, table, lengths, sinks = args
    run = lambda s, **extra: np.asarray(
        gqa_decode_attention(q, pool, table, lengths, s, **{**kw, **extra}, backend=BACKENDS[0], interpret=True)
    )
    live = LENGTHS > 0
    base = run(None)
    assert np.abs(run(sinks + 30.0)[live]).max() < 1e-6 * np.abs(base[live]).max()
    assert np.abs(run(None, softcap=0.5)[live] - base[live]).max() > 1e-2


def _valid_args():
    return dict(
        q=jnp.zeros((2, 8, 16)),
        kv_pool=jnp.zeros((8, 4, 64)),
        page_table=jnp.zeros((2, 3), jnp.int32),
        lengths=jnp.zeros((2,), jnp.int32),
        sinks=jnp.zeros((8,), jnp.float32),
    )


@pytest.mark.parametrize(
    "bad, kw, match",
    [
        (dict(q=jnp.zeros((2, 16))), {}, r"q.shape=\(2, 16\) must have rank 3"),
        (dict(), dict(num_kv_heads=3), r"num_kv_heads=3 must divide q.shape\[1\]=8"),
        (dict(), dict(num_kv_heads=0), r"num_kv_heads=0 must be in \[1, 8\]"),
        (dict(), dict(num_kv_heads=16), r"num_kv_heads=16 must be in \[1, 8\]"),
        (dict(kv_pool=jnp.zeros((8, 4, 64), jnp.bfloat16)), {}, r"kv_pool.dtype=bfloat16 must equal q.dtype=float32"),
        (dict(kv_pool=jnp.zeros((8, 4, 32))), {}, r"kv_pool.shape=\(8, 4, 32\).*must be 64"),
        (dict(), dict(shared_kv=True), r"kv_pool.shape=\(8, 4, 64\).*must be 32 \(num_kv_heads \* head_dim, K = V\)"),
        (dict(kv_pool=jnp.zeros((3, 8, 4, 64))), {}, r"layer=None: kv_pool.shape=\(3, 8, 4, 64\) is stacked"),
        (dict(), dict(layer=0), r"layer=.* must be None: kv_pool.shape=\(8, 4, 64\)"),
        (dict(lengths=jnp.zeros((3,), jnp.int32)), {}, r"lengths.shape=\(3,\).*must be 2"),
        (dict(lengths=jnp.zeros((2,), jnp.float32)), {}, r"lengths.dtype=float32"),
        (dict(page_table=jnp.zeros((2, 3), jnp.float32)), {}, r"page_table.dtype=float32"),
        (dict(sinks=jnp.zeros((2,), jnp.float32)), {}, r"sinks.shape=\(2,\).*must be 8"),
        (dict(sinks=jnp.zeros((8,), jnp.bfloat16)), {}, r"sinks.dtype=bfloat16"),
        (dict(), dict(window=0), r"window=0 must be in \[1, inf\]"),
        (dict(), dict(window=10), r"page_table.shape=\(2, 3\) must have at least 4 pages"),
        (dict(), dict(scale=-1.0), r"scale=-1.0 must be None"),
        (dict(), dict(softcap=0.0), r"softcap=0.0 must be None \(no capping\) or a positive"),
        (dict(), dict(backend="cpu"), r"backend='cpu' must be one of"),
    ],
)
def test_validation_errors(bad, kw, match):
    args = _valid_args()
    args.update(bad)
    kw = {"num_kv_heads": 2, **kw}
    with pytest.raises(ValueError, match=match):
        gqa_decode_attention(*args.values(), **kw)


def test_gpu_backend_needs_a_power_of_two_head_dim():
    args = _valid_args()
    args.update(q=jnp.zeros((2, 8, 24)), kv_pool=jnp.zeros((8, 4, 96)))
    with pytest.raises(ValueError, match=r"head_dim=24 must be a power of two"):
        gqa_decode_attention(*args.values(), num_kv_heads=2, backend="gpu", interpret=True)
