"""What this machine has: CPU, RAM, GPUs (pynvml when present), pinned memory."""
from __future__ import annotations

import platform

import psutil
import torch


def gpus() -> list[dict]:
    """One dict per CUDA device: name, memory, PCIe generation and width (pynvml if present)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gb": p.total_memory / 2**30,
                    **_pcie(i)})
    return out


def _pcie(i: int) -> dict:
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        return {"pcie_gen": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                "pcie_width": pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                "pcie_gen_max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
                "pcie_width_max": pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)}
    except Exception as e:  # pynvml missing or no NVML: report, never fail
        return {"pcie": f"unknown ({type(e).__name__})"}


def pinned_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError:
        return False


def system_info(compile_status=None) -> dict:
    """What `info` shows. `compile_status(device) -> str` says what --compile does there
    (runtime/graphs.py's, passed in by the CLI: offload/ does not import the runtime)."""
    vm = psutil.virtual_memory()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": psutil.cpu_count(logical=False),
        "cpu_threads": psutil.cpu_count(logical=True),
        "torch_threads": torch.get_num_threads(),
        "ram_total_gb": vm.total / 2**30,
        "ram_available_gb": vm.available / 2**30,
        "pinned_memory": pinned_available(),
        "gpus": gpus(),
        "cpu_kernels": cpu_kernels(),
        "gpu_attention": gpu_attention(),
        "gpu_compile": gpu_compile(compile_status),
        "gpu_quantized_linear": gpu_quantized_linear(),
        "gpu_linear": gpu_linear(),
    }


def gpu_linear() -> str:
    """Which kernel projections of decode, verification and draft steps (up to 64 rows)
    run on the first GPU, and why (kernels/triton_linear.py)."""
    if not torch.cuda.is_available():
        return "none (no CUDA device)"
    from ..kernels.triton_linear import status
    return status("cuda")


def gpu_quantized_linear() -> str:
    """Which kernel int8/int4 projections run on the first GPU (kernels/qlinear.py)."""
    if not torch.cuda.is_available():
        return "none (no CUDA device)"
    from ..kernels.qlinear import kernel
    return kernel("cuda")


def gpu_attention() -> str:
    """Which kernel decode/verify attention runs on the first GPU, and why (kernels/attention.py)."""
    if not torch.cuda.is_available():
        return "none (no CUDA device)"
    from ..kernels.attention import status
    return status("cuda")


def gpu_compile(compile_status=None) -> str:
    """What --compile does on the first GPU (`compile_status`: runtime/graphs.py's)."""
    if compile_status is None:
        return "unknown (ask the runtime: runtime.graphs.compile_status)"
    return compile_status("cuda" if torch.cuda.is_available() else "cpu")


def cpu_kernels() -> dict:
    """Which CPU kernels attention and float32 projections run on (kernels/)."""
    from ..kernels import linear, native, native_linear, qlinear
    return {"attention": native.status(),
            "layers": native_linear.program_status(),
            "float32_linear": "oneDNN" if linear.onednn_enabled() else "F.linear",
            "quantized_linear": qlinear.kernel("cpu", qlinear.activations("auto", "cpu"))}
