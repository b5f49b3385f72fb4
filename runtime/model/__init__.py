"""The model: configuration, loading (HF folders, GGUF, hub names), the forward, quantized
weights and tensor parallelism."""
