"""triforce-offload: lossless hierarchical speculative decoding with an offloaded KV cache.

This folder is the import root `triforce_offload` (setup.py maps it, and the top-level
runtime/ offload/ kernels/ cli/ benchmarks/lib into it). It is not named
`triforce_offload` on purpose: a folder of that name in the checkout's root would shadow
the installed package for anything run from there.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("triforce-offload")  # one source: setup.py
except PackageNotFoundError:  # not installed (a source tree on sys.path)
    __version__ = "0+unknown"
