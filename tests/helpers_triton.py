"""Triton kernels under TRITON_INTERPRET=1 in a child process: the variable only works if set
before triton is first imported, and anything in the suite may import triton first."""
import os
import subprocess
import sys

import torch


def interpreted(script: str, folder) -> dict:
    """What `script` (a test file run as `python script OUT`) saved to OUT, run with the
    interpreter on CPU tensors; `folder` a fresh directory."""
    path = folder / "out.pt"
    r = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(path)
