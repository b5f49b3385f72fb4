"""The native linear library (cpu_linear.c): built once by kernels/native.py, loaded with
ctypes, its entry points typed here. Both the quantized linears (qlinear.py) and the
row-exact float32 path of linear.py call it."""
from __future__ import annotations

import ctypes
from pathlib import Path

from . import native
from ..settings import env

SOURCE = Path(__file__).with_name("cpu_linear.c")
_lib = None  # ctypes handle, False once the build failed
_error = ""


def load():
    """The native library, or None (the reason in `reason()`)."""
    global _lib, _error
    if _lib is None:
        if env("native") == "0":
            _lib, _error = False, "disabled by TRIFORCE_OFFLOAD_NATIVE=0"
        else:
            try:
                lib = ctypes.CDLL(str(native.build(SOURCE)))
                P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                lib.triforce_qlinear.restype = I
                lib.triforce_qlinear.argtypes = [P, I64, I64, I64, P, I, I64, P, P, I, P, I64, P, I64]
                lib.triforce_qrows.restype = I
                lib.triforce_qrows.argtypes = [P, I64, I64, P, I, I64, P, P, I, I64, P]
                lib.triforce_linear_vector_bits.restype = I
                lib.triforce_qlinear_q8.restype = I  # + norm weight, eps, glu, residual, ldr, packed columns
                lib.triforce_qlinear_q8.argtypes = lib.triforce_qlinear.argtypes + [P, ctypes.c_float, I, P, I64, P]
                lib.triforce_qpack_bytes.restype = I64
                lib.triforce_qpack_bytes.argtypes = [I64, I, I64, I, I, I64]
                lib.triforce_qpack.restype = I
                lib.triforce_qpack.argtypes = [I64, P, I, I64, P, P, I, I64, P]
                lib.triforce_linear_vnni.restype = I
                lib.triforce_linear_f32.restype = I
                lib.triforce_linear_f32.argtypes = [P, I64, I64, I64, P, I64, P, I64, P, I64]
                lib.triforce_forward_layers.restype = I  # runtime/model/program.py
                lib.triforce_forward_layers.argtypes = ([I64, P, P, P, P, I64] + [P] * 7 + [I, ctypes.c_float, ctypes.c_float]
                                                        + [I64] * 6 + [P, I64, P, P, P])
                lib.triforce_forward_layers_seqs.restype = I
                lib.triforce_forward_layers_seqs.argtypes = ([I64, P, P, P, I64, P, I64] + [P] * 7
                                                             + [I, ctypes.c_float, ctypes.c_float]
                                                             + [I64] * 4 + [P, P, I64, P])
                _lib = lib
            except (OSError, RuntimeError, AttributeError) as e:
                _lib, _error = False, str(e)
    return _lib or None


def reason() -> str:
    load()
    return _error


def program_status() -> str:
    """How a CPU step's layers run (runtime/model/program.py), for `info`."""
    if env("program") == "0":
        return "a native call per op of each layer (TRIFORCE_OFFLOAD_PROGRAM=0)"
    if load() is None or not native.enabled():
        return "torch and native calls per op of each layer (no native kernels here)"
    return ("every layer of a step in one native call (plain pre-norm blocks, int8 activations, "
            "a full or retrieval cache; else a call per op)")
