"""The checkpoint tensors a DeepSeek-V4 config implies: canonical name -> (shape, dtype class).

Canonical names are the original DeepSeek release names (what transformers' `save_pretrained`
writes for `deepseek_v4`, without its `model.` prefix), e.g. `layers.3.attn.compressor.ape`,
`layers.0.ffn.experts.5.w1.weight`, `layers.2.hc_attn_fn`, `embed.weight`, `head.weight`.
Linear weights are stored `[out_features, in_features]` as in PyTorch.
"""

from __future__ import annotations

from .config import CSA, HASH_MOE, HCA, DeepseekV4Config

FLOAT = "float"
INT = "int"


def expected_tensors(cfg: DeepseekV4Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor a checkpoint for `cfg` must hold, with its shape and dtype class (FLOAT or INT)."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    hc = cfg.hc_mult
    mix = (2 + hc) * hc
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((cfg.vocab_size, d), FLOAT),
        "norm.weight": ((d,), FLOAT),
        "hc_head_fn": ((hc, hc * d), FLOAT),
        "hc_head_base": ((hc,), FLOAT),
        "hc_head_scale": ((1,), FLOAT),
    }
    if not cfg.tie_word_embeddings:
        out["head.weight"] = ((cfg.vocab_size, d), FLOAT)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = p + "attn."
        out.update(
            {
                p + "attn_norm.weight": ((d,), FLOAT),
                p + "ffn_norm.weight": ((d,), FLOAT),
                p + "hc_attn_fn": ((mix, hc * d), FLOAT),
                p + "hc_attn_base": ((mix,), FLOAT),
                p + "hc_attn_scale": ((3,), FLOAT),
                p + "hc_ffn_fn": ((mix, hc * d), FLOAT),
                p + "hc_ffn_base": ((mix,), FLOAT),
                p + "hc_ffn_scale": ((3,), FLOAT),
                a + "wq_a.weight": ((cfg.q_lora_rank, d), FLOAT),
                a + "q_norm.weight": ((cfg.q_lora_rank,), FLOAT),
                a + "wq_b.weight": ((h * hd, cfg.q_lora_rank), FLOAT),
                a + "wkv.weight": ((hd, d), FLOAT),
                a + "norm.weight": ((hd,), FLOAT),
                a + "wo_a.weight": ((cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups), FLOAT),
                a + "wo_b.weight": ((d, cfg.o_groups * cfg.o_lora_rank), FLOAT),
                a + "attn_sink": ((h,), FLOAT),
            }
        )
        lt = cfg.layer_types[i]
        if lt in (CSA, HCA):
            m = cfg.compress_rate(i)
            width = 2 * hd if lt == CSA else hd  # CSA carries two overlapping series (Ca | Cb)
            c = a + "compressor."
            out.update(
                {
                    c + "wkv.weight": ((width, d), FLOAT),
                    c + "wgate.weight": ((width, d), FLOAT),
                    c + "ape": ((m, width), FLOAT),
                    c + "norm.weight": ((hd,), FLOAT),
                }
            )
        if lt == CSA:
            m, ihd = cfg.compress_rate(i), cfg.index_head_dim
            x = a + "indexer."
            out.update(
                {
                    x + "compressor.wkv.weight": ((2 * ihd, d), FLOAT),
                    x + "compressor.wgate.weight": ((2 * ihd, d), FLOAT),
                    x + "compressor.ape": ((m, 2 * ihd), FLOAT),
                    x + "compressor.norm.weight": ((ihd,), FLOAT),
                    x + "wq_b.weight": ((cfg.index_n_heads * ihd, cfg.q_lora_rank), FLOAT),
                    x + "weights_proj.weight": ((cfg.index_n_heads, d), FLOAT),
                }
            )
        f = p + "ffn."
        inter = cfg.moe_intermediate_size
        out[f + "gate.weight"] = ((cfg.n_routed_experts, d), FLOAT)
        if cfg.mlp_layer_types[i] == HASH_MOE:
            out[f + "gate.tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), INT)
        else:
            out[f + "gate.bias"] = ((cfg.n_routed_experts,), FLOAT)
        for e in range(cfg.n_routed_experts):
            out[f + f"experts.{e}.w1.weight"] = ((inter, d), FLOAT)
            out[f + f"experts.{e}.w2.weight"] = ((d, inter), FLOAT)
            out[f + f"experts.{e}.w3.weight"] = ((inter, d), FLOAT)
        out[f + "shared_experts.w1.weight"] = ((inter, d), FLOAT)
        out[f + "shared_experts.w2.weight"] = ((d, inter), FLOAT)
        out[f + "shared_experts.w3.weight"] = ((inter, d), FLOAT)
    return out
