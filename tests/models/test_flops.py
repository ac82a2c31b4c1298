"""`models.deepseek_v4.flops`: the prefill arithmetic `benchmarks/roofline.py` holds hkv against,
counted off the model: the weights' products equal a count by hand from the config, a quantized
release checkpoint counts as the plain model, and attention and the indexer equal a per-query loop."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from models.deepseek_v4 import init, load, random_tensors, tiny_config
from models.deepseek_v4.config import CSA, HCA
from models.deepseek_v4.flops import prefill_flops, weight_products
from models.deepseek_v4.release import write_release_checkpoint

CFG = tiny_config()


def by_hand(cfg) -> int:
    """Multiply-adds of one token through the linear weights (experts at top-k), from the config."""
    d, q, h, hd, hc = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    total = hc * d * hc  # the final hyper-connection head
    for kind in cfg.layer_types:
        total += d * q + q * h * hd + d * hd  # wq_a, wq_b, the shared K=V head
        total += h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d  # wo_a (grouped), wo_b
        if kind == CSA:  # the overlapping compressor (2 x head_dim), the indexer and its compressor
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            total += 2 * d * 2 * hd + q * ih * idim + d * ih + 2 * d * 2 * idim
        elif kind == HCA:
            total += 2 * d * hd
        inter = cfg.moe_intermediate_size
        total += d * cfg.n_routed_experts + (cfg.num_experts_per_tok + 1) * 3 * d * inter  # router, experts, shared
        total += 2 * hc * d * (2 * hc + hc * hc)  # the two hyper-connection mixers
    return total


def test_the_weights_products_are_the_configs_count():
    model = init(CFG, seed=0)
    assert sum(p.macs_per_token for p in weight_products(model)) == by_hand(CFG)
    head = [p for p in weight_products(model) if p.name == "head"]
    assert len(head) == 1 and head[0].rows_per_token == 0  # the last row only
    f = prefill_flops(model, 100)
    assert f.weights == 2 * (100 * by_hand(CFG) + CFG.vocab_size * CFG.hidden_size)


def test_a_quantized_release_checkpoint_counts_as_the_plain_model(tmp_path):
    write_release_checkpoint(tmp_path, CFG, random_tensors(CFG, seed=0), fp8_block=16)
    quantized = load(tmp_path, dtype=jnp.float32)
    plain = init(CFG, seed=0)
    assert prefill_flops(quantized, 333) == prefill_flops(plain, 333)


def test_attention_and_indexer_equal_a_loop_over_queries():
    model = init(CFG, seed=0)
    t = 300
    keys = indexed = 0
    for pos in range(t):
        for kind in CFG.layer_types:
            keys += min(pos + 1, CFG.sliding_window)
            if kind == CSA:
                keys += min((pos + 1) // CFG.compress_rate_csa, CFG.index_topk)
                indexed += (pos + 1) // CFG.compress_rate_csa
            elif kind == HCA:
                keys += (pos + 1) // CFG.compress_rate_hca
    f = prefill_flops(model, t)
    assert f.attention == 4 * CFG.num_attention_heads * CFG.head_dim * keys
    assert f.indexer == 2 * CFG.index_n_heads * CFG.index_head_dim * indexed
    assert f.total == f.weights + f.attention + f.indexer
    with pytest.raises(ValueError, match=r"tokens=0 must be an integer >= 1"):
        prefill_flops(model, 0)
