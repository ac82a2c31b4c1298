"""A toy hybrid model (windowed, full and compressed layers) on hkv's public API: the example of
docs/bring-your-own-model.md.

from models import toy
model = toy.init(toy.ToyConfig(layers=(toy.Attn(window=4), toy.Attn(), toy.Compressed(ratio=4))), seed=0)
"""

from .model import Attn, Compressed, ToyConfig, ToyModel, init

__all__ = ["Attn", "Compressed", "ToyConfig", "ToyModel", "init"]
