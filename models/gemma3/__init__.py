"""Gemma 3 (text) in Flax NNX: config, checkpoint loading, random init and the stateless forward.

from models import gemma3
model = gemma3.load("/path/to/gemma-3-1b-it", dtype="bfloat16")
logits = gemma3.forward_fn(model)(tokens)          # int32[B, T] -> float32[B, T, vocab]
tiny = gemma3.init(gemma3.tiny_config(), seed=0)

Sliding layers attend to `cfg.window` (== HF `sliding_window`) tokens including the current one.
"""

from .checkpoint import CheckpointError, load
from .config import FULL, GEMMA3_27B_HF, SLIDING, ConfigError, Gemma3Config, RopeSpec, gemma3_27b_config, tiny_config
from .model import Gemma3, attention_mask, dense_attention, forward_fn, greedy_stateless, init, random_tensors

__all__ = [
    "FULL",
    "GEMMA3_27B_HF",
    "SLIDING",
    "CheckpointError",
    "ConfigError",
    "Gemma3",
    "Gemma3Config",
    "RopeSpec",
    "attention_mask",
    "dense_attention",
    "forward_fn",
    "gemma3_27b_config",
    "greedy_stateless",
    "init",
    "load",
    "random_tensors",
    "tiny_config",
]
