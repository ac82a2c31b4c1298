"""Build tiny random DeepSeek-V4 models with transformers itself (the public reference), for parity tests."""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import DeepseekV4Config as HFConfig
from transformers import DeepseekV4ForCausalLM

from models.deepseek_v4 import DeepseekV4Config


@contextlib.contextmanager
def reproducible_torch():
    """transformers' reference computed reproducibly: one intra-op thread (torch splits a reduction by
    its thread count, so its float32 sums, and a router's or indexer's near-tie picks downstream, moved
    with the machine's load: a parity test failed for nothing and passed on a re-run) and deterministic
    algorithms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def build_hf_model(cfg: DeepseekV4Config, seed: int = 0) -> DeepseekV4ForCausalLM:
    """A transformers DeepSeek-V4 for `cfg` with EVERY parameter and buffer randomised (sinks, position
    biases, mHC bases, router biases, hash tables too), so no code path hides behind a zero init."""
    torch.manual_seed(seed)
    return randomize(DeepseekV4ForCausalLM(HFConfig(**cfg.to_hf_dict())).eval(), seed)


def randomize(model: DeepseekV4ForCausalLM, seed: int) -> DeepseekV4ForCausalLM:
    """Every parameter and buffer of `model` random, in place (norm weights 1 + 0.2 N(0,1), vectors and
    position biases 0.3 N(0,1), matrices 0.06 N(0,1), hash tables random expert picks, router biases
    0.1 N(0,1)); deterministic in `seed`. Also used by `benchmarks/e2e.py`."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1 or name.endswith("position_bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.06 * noise)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [
                    torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                    for _ in range(b.shape[0])
                ]
                b.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def save_hf_model(model: DeepseekV4ForCausalLM, path: str | os.PathLike, **kwargs) -> None:
    """`save_pretrained` into `path` (kwargs e.g. max_shard_size for sharded checkpoints)."""
    model.save_pretrained(str(path), **kwargs)
