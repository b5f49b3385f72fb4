"""Every candidate kernel for a model's projections, ms per token beside float32.

Usage:
    python benchmarks/linear_kernels.py                    # SmolLM2-135M's shapes, 1 thread
    python benchmarks/linear_kernels.py --rows 7 --threads 2
    python benchmarks/linear_kernels.py --hidden 4096 --intermediate 14336 --layers 4 --kv-heads 8 --heads 32

One "token" is every projection of every layer plus the LM head for `--rows` rows of
activations (1: a decode; γ+1: a verification), each layer with weights of its own (so the
weights stream from memory as in a real model, not from cache). Candidates:
- fp32: the dense float32 weights through the runtime's `linear` (oneDNN on x86);
- bf16: dense bfloat16 weights with bfloat16 activations (F.linear);
- int8pack-bf16: torch's `_weight_int8pack_mm` (per-channel int8, bf16 activations);
- native-int8 / native-int4: kernels/cpu_linear.c (int8 per 32, int4 per 32 with offsets),
  float32 activations. `rows_equal` says whether each row of a batch equals that row alone,
  which speculative decoding needs (native: always).
Prints one line per candidate with ms/token, GB/s over the weight bytes and the ratio to fp32,
and appends them as JSON lines to `--out` when given.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from triforce_offload.kernels import qlinear
from triforce_offload.kernels.linear import linear


def shapes(a) -> list[tuple[int, int]]:
    d = a.hidden // a.heads
    return [((a.heads + 2 * a.kv_heads) * d, a.hidden), (a.hidden, a.heads * d),
            (2 * a.intermediate, a.hidden), (a.hidden, a.intermediate)]


def candidates(a):
    """name -> (make(w) -> weight object, run(obj, x))"""
    out = {
        "fp32": (lambda w: w, lambda o, x: linear(x, o)),
        "bf16": (lambda w: w.bfloat16(), lambda o, x: F.linear(x.bfloat16(), o)),
        "native-int8": (lambda w: qlinear.QLinear([qlinear.quantize(w, 8, 32)]), lambda o, x: o(x)),
        "native-int4": (lambda w: qlinear.QLinear([qlinear.quantize(w, 4, 32)]), lambda o, x: o(x)),
    }
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        def int8pack(w):
            s = w.abs().amax(1) / 127
            return (w / s[:, None]).round().to(torch.int8), s.bfloat16()
        out["int8pack-bf16"] = (int8pack, lambda o, x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), o[0], o[1]))
    return out


def nbytes(o) -> int:
    if isinstance(o, torch.Tensor):
        return o.numel() * o.element_size()
    if isinstance(o, tuple):
        return sum(nbytes(t) for t in o)
    return o.nbytes()


def measure(make, run, a, g) -> dict:
    layers = [[make(torch.randn(n, k, generator=g) * 0.02) for n, k in shapes(a)] for _ in range(a.layers)]
    head = make(torch.randn(a.vocab, a.hidden, generator=g) * 0.02)
    xs = {k: torch.randn(a.rows, k, generator=g) for _, k in shapes(a)}

    def token():
        for ws in layers:
            for w, (_, k) in zip(ws, shapes(a)):
                run(w, xs[k])
        return run(head, xs[a.hidden])

    token()
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        token()
        times.append(time.perf_counter() - t)
    ms = sorted(times)[len(times) // 2] * 1e3
    total = sum(nbytes(w) for ws in layers for w in ws) + nbytes(head)
    x = xs[a.hidden]
    full = run(head, x)
    rows = all(torch.equal(full[i:i + 1].float(), run(head, x[i:i + 1]).float()) for i in range(a.rows))
    return {"ms_per_token": round(ms, 2), "weight_mb": round(total / 1e6, 1),
            "gb_per_s": round(total / ms / 1e6, 1), "rows_equal": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--only", default="", help="comma-separated candidate names")
    p.add_argument("--out", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"# {a.layers} layers, hidden {a.hidden}, rows {a.rows}, threads {a.threads}; "
          f"quantized kernel: {qlinear.kernel()}")
    base = None
    with torch.inference_mode():
        for name, (make, run) in candidates(a).items():
            if a.only and name not in a.only.split(","):
                continue
            r = measure(make, run, a, torch.Generator().manual_seed(0))
            base = base or r["ms_per_token"]
            r = {"candidate": name, **r, "vs_fp32": round(base / r["ms_per_token"], 2),
                 "rows": a.rows, "threads": a.threads, "layers": a.layers, "hidden": a.hidden}
            print(json.dumps(r), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
