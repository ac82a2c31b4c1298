"""Backend resolution, the package's public surface, and one compile per shape bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import dispatch, testing


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto resolution on a CPU host")
def test_auto_backend_on_cpu():
    assert dispatch.resolve_backend(None, interpret=False) == "reference"
    assert dispatch.resolve_backend(None, interpret=True) == "gpu"  # interpreted Triton-style kernel


@pytest.mark.parametrize("backend", dispatch.BACKENDS)
def test_explicit_backends_are_kept(backend):
    assert dispatch.resolve_backend(backend, interpret=False) == backend


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend='mosaic' must be one of \('gpu', 'tpu', 'reference'\)"):
        dispatch.resolve_backend("mosaic", interpret=False)


def test_interpret_argument_per_backend():
    assert dispatch.pallas_interpret_arg("gpu", False) is False
    assert dispatch.pallas_interpret_arg("gpu", True) is True
    assert isinstance(dispatch.pallas_interpret_arg("tpu", True), jax.experimental.pallas.tpu.InterpretParams)


def test_public_names():
    for name in pallas_kernels.__all__:
        assert getattr(pallas_kernels, name).__doc__, name


@pytest.mark.parametrize("backend", ["reference", testing.KERNEL_BACKENDS[0]])
def test_new_lengths_and_indices_do_not_recompile(backend):
    # Lengths, counts and picks are data: a decode loop compiles once per shape bucket.
    rng = np.random.default_rng(0)
    fn = pallas_kernels.csa_decode_attention

    def call(lengths, picks):
        win = testing.window_case(
            rng,
            np.float32,
            lengths,
            heads=4,
            head_dim=16,
            page_size=4,
            window=5,
            pages_per_seq=4,
            num_pages=16,
            poison_outside_window=False,
        )
        comp = testing.entry_case(
            rng, np.float32, [np.arange(4)] * 2, np.array([4, 4]), dim=16, page_size=2, pages_per_seq=2, num_pages=8
        )
        args = (
            win["q"],
            win["window_pool"],
            win["window_page_table"],
            win["lengths"],
            win["sinks"],
            comp["pool"],
            comp["page_table"],
            comp["n_written"],
            np.asarray(picks, np.int32),
        )
        return fn(*map(jnp.asarray, args), window=5, compress_ratio=2, backend=backend, interpret=testing.INTERPRET)

    call(np.array([3, 9], np.int32), [[0, -1, 1], [3, 2, 1]])
    before = fn._cache_size()
    call(np.array([16, 1], np.int32), [[-1, -1, -1], [0, 1, 2]])
    call(np.array([0, 12], np.int32), [[2, 0, 1], [-1, 3, -1]])
    assert fn._cache_size() == before


def test_describe_backend_names_what_runs():
    from pallas_kernels.dispatch import describe_backend

    platform = jax.default_backend()
    assert describe_backend("reference") == f"the jnp reference (XLA) on {platform}"
    assert describe_backend("tpu", interpret=True) == f"Pallas kernels (Mosaic) in the Pallas interpreter on {platform}"
    assert describe_backend("gpu") == f"Pallas kernels (Triton) on {platform}"
    with pytest.raises(ValueError, match="backend='cuda'"):
        describe_backend("cuda")
