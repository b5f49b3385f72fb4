"""triforce_offload.bench: the benchmark library (this folder, `benchmarks/lib/`).

What `triforce-offload bench`/`tune` and the scripts in `benchmarks/` share; the runtime
knows nothing of it.

| module | what |
|---|---|
| `runner.py` | `bench`: every mode and the outside references on one model and prompt |
| `peers.py` | the outside references: transformers, llama.cpp, DeepSpeed ZeRO-Inference |
| `zero_inference.py` | ZeRO-Inference's KV strategy on our model, the mode `zero-inference` |
| `plots.py` | PNG plots of `bench` and the needle-in-a-haystack grid |
| `offload_timing.py` | timed verifications through the offload pipeline (`tune`, offload_pipeline.py) |
| `prefill.py` | one essay prompt per context prefilled once (speedup.py, retrieval_*.py) |
| `geometries.py` | random-weight models of known shapes (gpu_decode.py, offload_pipeline.py) |
| `servers.py` | servers as contenders: started on free ports, stopped by PID; a streamed request's events (serve_clients.py, serve_gap.py) |
"""
