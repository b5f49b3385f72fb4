"""triforce-offload: lossless hierarchical speculative decoding with an offloaded KV cache."""
from setuptools import setup

# One import root: package/ is `triforce_offload` itself (a checkout-root folder named
# triforce_offload would shadow the installed package), the top-level folders are mapped
# into it, and the benchmark library beside the benchmark scripts becomes `triforce_offload.bench`.
SUBPACKAGES = {"runtime": "runtime", "runtime.model": "runtime/model", "runtime.cache": "runtime/cache",
               "runtime.spec": "runtime/spec", "runtime.batch": "runtime/batch", "offload": "offload",
               "kernels": "kernels", "cli": "cli", "server": "server", "bench": "benchmarks/lib"}

setup(
    name="triforce-offload",
    version="0.1.0",
    description="Long-context LLM serving on consumer GPUs by TriForce speculative decoding "
    "with the KV cache in host memory",
    python_requires=">=3.10",
    packages=["triforce_offload"] + [f"triforce_offload.{p}" for p in SUBPACKAGES],
    package_dir={"triforce_offload": "package",
                 **{f"triforce_offload.{p}": d for p, d in SUBPACKAGES.items()}},
    package_data={"triforce_offload.kernels": ["*.c"]},  # the native kernel, compiled on first use
    install_requires=[
        "torch>=2.4",  # install torch==2.13.0 first: a bare `torch` pulls a CUDA build
        "transformers>=4.45",
        "accelerate",
        "gguf",
        "safetensors",
        "typer",
        "rich",
        "psutil",
        "numpy",
    ],
    extras_require={
        "gpu": ["flash-attn", "nvidia-ml-py"],
        "bench": ["matplotlib", "llama-cpp-python"],
        "deepspeed": ["deepspeed"],
        "serve": ["fastapi", "uvicorn"],
        "test": ["pytest", "scipy", "matplotlib", "triton; platform_system == 'Linux'", "openai", "httpx"],
    },
    entry_points={"console_scripts": ["triforce-offload=triforce_offload.cli.app:main"]},
)
