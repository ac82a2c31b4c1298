"""Parity of the Flax NNX DeepSeek-V4 with transformers' `deepseek_v4` (the reference implementation).

Each case builds a tiny random model WITH transformers, saves it with `save_pretrained`, loads it with
`models.deepseek_v4.load`, and requires fp32 logits within 1e-4 on >= 300-token sequences (many window
and compression boundaries) and identical greedy continuations.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.deepseek_v4 import RopeSpec, forward_fn, load, tiny_config
from models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from models.stateless import greedy_stateless

from .hf_reference import build_hf_model, reproducible_torch, save_hf_model

pytestmark = pytest.mark.parity

CASES = {
    # every layer type, m = 4/16, window 8, hc_mult 2, hash then top-k MoE, sqrt-softplus router
    "csa4_hca16_w8_hc2": tiny_config(),
    # another layer order, m = 4/32, window 16, hc_mult 3, YaRN on the compress rope
    # (scoring_func="softmax" is documented by transformers 5.24 but missing from its ACT2FN, so untestable)
    "csa4_hca32_w16_hc3_yarn": tiny_config(
        num_hidden_layers=5,
        layer_types=(HCA, CSA, SLIDING, HCA, CSA),
        mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE, MOE),
        compress_rate_hca=32,
        sliding_window=16,
        hc_mult=3,
        rope_compress=RopeSpec(
            theta=160000.0,
            rope_type="yarn",
            factor=16.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
    ),
    # CSA first, top-k larger than the number of entries (every causal entry selected), sigmoid router
    "csa_first_topk_all_sigmoid": tiny_config(
        num_hidden_layers=3,
        layer_types=(CSA, SLIDING, HCA),
        mlp_layer_types=(MOE, HASH_MOE, MOE),
        index_topk=128,
        scoring_func="sigmoid",
        num_experts_per_tok=3,
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    cfg = CASES[request.param]
    hf = build_hf_model(cfg, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    save_hf_model(hf, path)
    ours = load(path, dtype=jnp.float32)
    assert dataclasses.replace(ours.cfg, quantization=None) == cfg
    return hf, ours


def test_logits_match_transformers(pair):
    hf, ours = pair
    rng = np.random.default_rng(7)
    ids = rng.integers(0, ours.cfg.vocab_size, (2, 307))
    got = np.asarray(forward_fn(ours)(ids))
    with reproducible_torch(), torch.no_grad():
        want = hf(torch.tensor(ids)).logits.float().numpy()
    assert got.shape == want.shape == (2, 307, ours.cfg.vocab_size)
    err = np.abs(got - want).max()
    assert err < 1e-4, (
        f"max |logit diff| {err:.3g} (first bad position {np.argmax(np.abs(got - want).max(axis=(0, 2)) >= 1e-4)})"
    )


def test_greedy_continuation_matches_transformers_generate(pair):
    hf, ours = pair
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, ours.cfg.vocab_size, n).tolist() for n in (300, 257)]
    new = 12
    tokens, logits = greedy_stateless(ours, prompts, new)
    for prompt, toks, lg in zip(prompts, tokens, logits, strict=True):
        with reproducible_torch(), torch.no_grad():
            ids = torch.tensor([prompt])
            # explicit all-ones mask: otherwise generate() treats every id equal to pad_token_id as padding
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        assert out.sequences[0, len(prompt) :].tolist() == toks
        want = torch.stack(out.logits, dim=1)[0].float().numpy()
        assert np.abs(lg - want).max() < 1e-4
