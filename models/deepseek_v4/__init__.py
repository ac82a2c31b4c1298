"""DeepSeek-V4 in Flax NNX: config, checkpoint loading, random init and the stateless forward.

from models import deepseek_v4
model = deepseek_v4.load("/path/to/DeepSeek-V4-Flash", dtype=jnp.bfloat16)
logits = deepseek_v4.forward_fn(model)(tokens)          # int32[B, T] -> float32[B, T, vocab]
tiny = deepseek_v4.init(deepseek_v4.tiny_config(), seed=0)
"""

from .config import ConfigError, DeepseekV4Config, RopeSpec, flash_config, tiny_config
from .model import DeepseekV4, expert_parallel_dim, forward_fn, init, load, random_tensors, tensor_parallel_dim

__all__ = [
    "ConfigError",
    "DeepseekV4",
    "DeepseekV4Config",
    "RopeSpec",
    "expert_parallel_dim",
    "flash_config",
    "forward_fn",
    "init",
    "load",
    "random_tensors",
    "tensor_parallel_dim",
    "tiny_config",
]
