"""The kernels lower for their real targets at DeepSeek-V4-Flash shapes, without a device.

`jit(...).trace(...).lower(lowering_platforms=...)` runs the Pallas Triton lowering (GPU) and the
Mosaic lowering (TPU) on CPU. That catches what interpret mode cannot: non-power-of-two Triton
blocks, unsupported ops, Mosaic block-shape and DMA-shape rules. It does not run the Triton/Mosaic
compilers that follow (ptxas, the TPU backend), which only the device checks exercise.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.csa_decode import csa_decode_attention
from pallas_kernels.gather import paged_gather
from pallas_kernels.gqa_decode import gqa_decode_attention
from pallas_kernels.hca_decode import hca_decode_attention
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.swa_decode import swa_decode_attention

# DeepSeek-V4-Flash attention layer, 3 sequences, 64K-token capacity, 64-row pages; pool sizes are
# deliberately not powers of two.
BATCH, HEADS, HEAD_DIM, WINDOW, PAGE = 3, 64, 512, 128, 64
CONTEXT, CSA_RATIO, HCA_RATIO, TOPK, IDX_HEADS, IDX_DIM = 65536, 4, 128, 512, 64, 128
# A GQA layer (Llama-3-70B-like: 64 query heads on 8 KV heads of 128) over K|V rows.
GQA_HEADS, GQA_KV_HEADS, GQA_DIM = 64, 8, 128
TARGETS = {"cuda": ("gpu", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


def _s(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _inputs(dtype):
    window = (
        _s((BATCH, HEADS, HEAD_DIM), dtype),
        _s((300, PAGE, HEAD_DIM), dtype),
        _s((BATCH, CONTEXT // PAGE)),
        _s((BATCH,)),
        _s((HEADS,), jnp.float32),
    )
    csa_pages = CONTEXT // CSA_RATIO // PAGE
    csa = (_s((BATCH * csa_pages + 5, PAGE, HEAD_DIM), dtype), _s((BATCH, csa_pages)), _s((BATCH,)))
    hca_pages = CONTEXT // HCA_RATIO // PAGE
    hca = (_s((BATCH * hca_pages + 5, PAGE, HEAD_DIM), dtype), _s((BATCH, hca_pages)), _s((BATCH,)))
    indexer = (
        _s((BATCH, IDX_HEADS, IDX_DIM), dtype),
        _s((BATCH, IDX_HEADS), dtype),
        _s((BATCH * csa_pages + 5, PAGE, IDX_DIM), dtype),
        _s((BATCH, csa_pages)),
        _s((BATCH,)),
        _s((BATCH,)),
    )
    return window, csa, hca, indexer


def _ops(backend, dtype):
    window, csa, hca, indexer = _inputs(dtype)
    gqa = (
        _s((BATCH, GQA_HEADS, GQA_DIM), dtype),
        _s((300, PAGE, 2 * GQA_KV_HEADS * GQA_DIM), dtype),
        _s((BATCH, CONTEXT // PAGE)),
        _s((BATCH,)),
        _s((GQA_HEADS,), jnp.float32),
    )
    return {
        "paged_gather": (lambda *a: paged_gather(*a, backend=backend), (window[1], window[2], window[3])),
        "swa": (lambda *a: swa_decode_attention(*a, window=WINDOW, backend=backend), window),
        "hca": (
            lambda *a: hca_decode_attention(*a, window=WINDOW, compress_ratio=HCA_RATIO, backend=backend),
            window + hca,
        ),
        "csa": (
            lambda *a: csa_decode_attention(*a, window=WINDOW, compress_ratio=CSA_RATIO, backend=backend),
            window + csa + (_s((BATCH, TOPK)),),
        ),
        "indexer": (lambda *a: indexer_topk(*a, k=TOPK, compress_ratio=CSA_RATIO, backend=backend), indexer),
        "gqa": (
            lambda *a: gqa_decode_attention(*a, num_kv_heads=GQA_KV_HEADS, softcap=50.0, backend=backend),
            gqa,
        ),
        # MQA over DeepSeek-style K=V rows, sliding window.
        "gqa_mqa_window": (
            lambda *a: gqa_decode_attention(*a, num_kv_heads=1, window=WINDOW, shared_kv=True, backend=backend),
            window,
        ),
        "gqa_stacked": (
            lambda layer, *a: gqa_decode_attention(*a, num_kv_heads=GQA_KV_HEADS, layer=layer, backend=backend),
            (_s(()), gqa[0], _s((4,) + gqa[1].shape, dtype)) + gqa[2:],
        ),
        # Pools stacked over 4 layers, read in place at a traced layer index.
        "csa_stacked": (
            lambda layer, *a: csa_decode_attention(
                a[0],
                a[1],
                a[2],
                a[3],
                a[4],
                a[5],
                a[6],
                a[7],
                a[8],
                window=WINDOW,
                compress_ratio=CSA_RATIO,
                window_layer=layer,
                compressed_layer=layer,
                backend=backend,
            ),
            (_s(()), window[0], _s((4,) + window[1].shape, dtype))
            + window[2:]
            + (_s((4,) + csa[0].shape, dtype),)
            + csa[1:]
            + (_s((BATCH, TOPK)),),
        ),
    }


@pytest.mark.parametrize("platform", sorted(TARGETS))
@pytest.mark.parametrize(
    "op", ["paged_gather", "swa", "hca", "csa", "indexer", "csa_stacked", "gqa", "gqa_mqa_window", "gqa_stacked"]
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_the_platform_kernel(platform, op, dtype):
    backend, custom_call = TARGETS[platform]
    fn, args = _ops(backend, dtype)[op]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text
