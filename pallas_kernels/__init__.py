"""Pallas kernels for the paged pools of a hybrid-attention KV cache (DeepSeek-V4 layout).

Array in, array out; nothing here knows about hkv. Every op has a Pallas GPU kernel (Triton
lowering), a Pallas TPU kernel (Mosaic), and a plain-jnp reference, behind one public function:

    paged_gather(pool, page_table, lengths)                                  -> [B, P*ps, D]
    swa_decode_attention(q, window_pool, window_page_table, lengths, sinks, *, window)
    hca_decode_attention(q, window_pool, window_page_table, lengths, sinks,
                         compressed_pool, compressed_page_table, n_compressed,
                         *, window, compress_ratio)                          -> [B, H, D]
    csa_decode_attention(q, window_pool, window_page_table, lengths, sinks,
                         compressed_pool, compressed_page_table, n_compressed, topk_indices,
                         *, window, compress_ratio)                          -> [B, H, D]
    gqa_decode_attention(q, kv_pool, page_table, lengths, sinks,
                         *, num_kv_heads, window=None, softcap=None, shared_kv=False)  -> [B, H, D]
    indexer_scores(q_idx, weights, index_pool, index_page_table, lengths, n_entries,
                   *, compress_ratio)                                         -> f32[B, C]
    indexer_topk(q_idx, weights, index_pool, index_page_table, lengths, n_entries,
                 *, k, compress_ratio)                                        -> int32[B, k]

All also take `backend: str | None = None` ("gpu", "tpu", "reference"; None = by
`jax.default_backend()`, the reference on CPU) and `interpret: bool = False` (run the Pallas kernel
in the interpreter); see `pallas_kernels.dispatch`. All are jitted with static shapes: lengths,
counts and indices are data, so one compile serves every step of a shape bucket.

Layout (the cache adopts it):

* A pool is `[num_pages, page_size, dim]` for one layer and object (window K=V rows, compressed
  entries, index keys), or `[layers, num_pages, page_size, dim]` stacked over the layers of a group
  that share one page table, passed with its layer index (`layer=`, `window_layer=`,
  `compressed_layer=`, `index_layer=`; an int or a traced int32 scalar, e.g. inside a scan over
  layers). A stacked pool is read in place (see `pallas_kernels.stacked_pools`); do not slice
  `pool[layer]` yourself, which inside jit copies the layer's whole pool on every call.
* A page table is `int32[batch, pages_per_seq]`: logical page i of sequence b is physical page
  `page_table[b, i]`. Entries of logical pages a kernel does not need are never read and may hold
  anything (-1 for unallocated).
* Window rows are addressed by absolute position: token p of sequence b is row p % page_size of
  logical page p // page_size, looked up at `window_page_table[b, (p // page_size) % pages_per_seq]`.
  A table covering the whole context works unchanged; a short table (>= cdiv(window - 1,
  page_size) + 1 entries) is a ring of window pages the cache recycles.
* Compressed entry w (and index key w) is row w % page_size of logical page w // page_size of its
  own pool and page table; `n_compressed` / `n_entries` count the entries written per sequence.
* `lengths[b]` counts the tokens of sequence b including the one being decoded (its K=V row must
  already be written); 0 marks an empty batch slot, which reads nothing and returns zeros.
* A GQA pool row (`gqa_decode_attention`) holds one token's keys and values of every KV head:
  [K head 0 | ... | K head Hkv-1 | V head 0 | ... | V head Hkv-1] (2 * Hkv * head_dim), or only the
  K heads with `shared_kv=True` (V = K). Query head h uses KV head h // (num_heads // num_kv_heads).
  Rows are addressed by absolute position like window rows; with `window=None` (full attention)
  the table must cover max(lengths) (a longer sequence sees its last pages_per_seq * page_size
  positions).
* q and every pool of one call share a dtype (bf16 or f32); sinks are f32; softmax accumulates in
  f32 and the output has q's dtype.
"""

from pallas_kernels.csa_decode import csa_decode_attention, csa_decode_attention_reference
from pallas_kernels.dispatch import BACKENDS, resolve_backend
from pallas_kernels.gather import paged_gather, paged_gather_reference
from pallas_kernels.gqa_decode import gqa_decode_attention, gqa_decode_attention_reference
from pallas_kernels.hca_decode import hca_decode_attention, hca_decode_attention_reference
from pallas_kernels.indexer import indexer_scores, indexer_scores_reference, indexer_topk, indexer_topk_reference
from pallas_kernels.swa_decode import swa_decode_attention, swa_decode_attention_reference

__all__ = [
    "BACKENDS",
    "csa_decode_attention",
    "csa_decode_attention_reference",
    "gqa_decode_attention",
    "gqa_decode_attention_reference",
    "hca_decode_attention",
    "hca_decode_attention_reference",
    "indexer_scores",
    "indexer_scores_reference",
    "indexer_topk",
    "indexer_topk_reference",
    "paged_gather",
    "paged_gather_reference",
    "resolve_backend",
    "swa_decode_attention",
    "swa_decode_attention_reference",
]
