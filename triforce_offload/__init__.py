"""triforce-offload: lossless hierarchical speculative decoding with an offloaded KV cache."""

__version__ = "0.1.0"
