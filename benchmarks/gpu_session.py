"""Everything a GPU should measure for this project, in calls of at most ten minutes.

Usage (on the GPU machine, from the project root, after `. .gpu/bin/env.sh`; its image has
`python3`, maybe no `python`; see docs/gpu.md, "Measuring on a GPU", for what each call
carries):
    python3 benchmarks/gpu_session.py a                    # cuda tests, resident decode
    python3 benchmarks/gpu_session.py b                    # offloaded; real weights: /root/w/smol.gguf
    python3 benchmarks/gpu_session.py c                    # --compile against graphs alone
    python3 benchmarks/gpu_session.py d                    # batches: tokens/s against batch size
    python3 benchmarks/gpu_session.py a --dry-run          # print the commands only
    python3 benchmarks/gpu_session.py a --smoke            # the same commands shrunk, on the CPU

Stage `a` (first call): the device, `triforce-offload info`, `gpu_decode.py` on the
SmolLM2 and Llama-2-7B geometries (eager, graphed, triforce) against the HBM floor, then
the tests marked `cuda`. Stage `b` (second call; the bundled GGUF's halves are joined by
then if the machine stayed warm): `offload_pipeline.py` against the PCIe floor (7B
geometry at 16K, SmolLM2 at 32K), the real SmolLM2 with essay text (graphed
autoregressive against triforce on the resident cache; `bench` with the offloaded
contenders autoregressive+offload, retrieval+offload and triforce+offload at 32K), and
last the 7B geometry at 128K with its offloaded prefill timed. Without the model file the
geometry commands run and the real-model ones are skipped with a note. These are the
issue targets' measurements (GPU decode at memory speed, offloaded decode at the link's
speed). Stage `c` (third call, when time is left): graphed against compiled
autoregressive (`--compile`, torch.compile under the captured step; compile seconds
reported apart) on the SmolLM2 and 7B geometries, what decides whether `--compile`
becomes the default on CUDA. Stage `d` (a call of its own; second where batches are the
question): the batch tests marked `cuda`, then `gpu_decode.py --batch` on the 7B geometry
(1, 4, 8, 16 sequences at 8K; 1 and 4 at 32K), graphed autoregressive and triforce, beside
the floor, and the single-stream 8K decode on cuBLAS (TRIFORCE_OFFLOAD_GPU_LINEAR=cublas)
against stage a's on the row-exact Triton projections.

Each command runs under a deadline (the stage's `--budget-s`, 450 s by default, shared in
order: with env.sh's set-up the call stays under 540 s, of the 600 s a GPU command may run);
each stage's per-command limits add up to at most that. A command that would start with
less than a minute left is skipped and listed, so a call ends with its logs rather than
being killed. Output: `$OUT` (or `--out`) gets
`<stage>.log` (every command's output, with its exit status and seconds) and
`<stage>.jsonl` (the rows the benchmarks append), and `bench/bench.jsonl` in stage b:
few files, as the device tool returns at most eight.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_START_S = 60  # a command that cannot get this long is not started
CALL_S = 540  # what one call may take: the GPU machines run a command 600 s at most
SETUP_S = 90  # env.sh in the same call: the wheels once per machine, the project every call
BUDGET_S = CALL_S - SETUP_S  # a stage's default budget; its commands' limits add up to no more
REAL = ("decode real", "bench offload")  # stage b's commands that need the real checkpoint


def cli() -> list[str]:
    """The console script: on PATH, beside this interpreter, or in a `pip install --target`
    folder on PYTHONPATH (the GPU kit's /tmp/site/bin), else `python -m triforce_offload.cli`."""
    dirs = [Path(sys.executable).parent] + [Path(p) / "bin" for p in
                                            os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for exe in [shutil.which("triforce-offload")] + [d / "triforce-offload" for d in dirs]:
        if exe and Path(exe).exists():
            return [str(exe)]
    return [sys.executable, "-m", "triforce_offload.cli"]


def stage_a(out: Path, smoke: bool) -> list[tuple[str, list[str], int]]:
    """(name, argv, timeout_s) of the first call."""
    py, jl = sys.executable, str(out / "a.jsonl")
    gd = [py, "benchmarks/gpu_decode.py", "--out", jl]
    if smoke:
        gd += ["--device", "cpu", "--layers", "2", "--new-tokens", "4", "--copy-mib", "16", "--threads", "1"]
        small, big = ["--contexts", "256"], ["--contexts", "256"]
    else:
        gd += ["--new-tokens", "64", "--repeats", "2"]
        small, big = ["--contexts", "4096", "32768"], ["--contexts", "4096", "16384", "32768"]
    cmds = [("info", [*cli(), "info"], 40)]
    if not smoke:
        cmds.insert(0, ("device", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pcie.link.gen.current",
                                   "--format=csv"], 20))
    cmds += [("decode smollm2", [*gd, "--geometry", "smollm2", *small,
                                 "--modes", "eager", "graphed", "triforce"], 110),
             ("decode llama2-7b", [*gd, "--geometry", "llama2-7b", *big, "--modes", "eager", "graphed"], 140)]
    if not smoke:
        cmds.append(("cuda tests", [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p",
                                    "no:cacheprovider", "tests"], 140))
    return cmds


def stage_c(out: Path, smoke: bool) -> list[tuple[str, list[str], int]]:
    """(name, argv, timeout_s) of the third call: --compile against graphs alone."""
    py, jl = sys.executable, str(out / "c.jsonl")
    gd = [py, "benchmarks/gpu_decode.py", "--out", jl, "--modes", "graphed", "compiled"]
    if smoke:
        gd += ["--device", "cpu", "--layers", "2", "--new-tokens", "4", "--copy-mib", "16", "--threads", "1"]
        return [("compile smollm2", [*gd, "--geometry", "smollm2", "--contexts", "256"], 240)]
    gd += ["--new-tokens", "64", "--repeats", "2"]
    return [("compile smollm2", [*gd, "--geometry", "smollm2", "--contexts", "4096", "32768"], 210),
            ("compile llama2-7b", [*gd, "--geometry", "llama2-7b", "--contexts", "16384"], 240)]


def stage_d(out: Path, smoke: bool) -> list[tuple[str, list[str], int]]:
    """(name, argv, timeout_s) of the batch call (issue 36's GPU target): the batch tests
    marked `cuda` (each sequence its solo run on the row-exact Triton projections), then
    aggregate tokens/s against batch size on the 7B geometry at 8K and 32K, graphed
    autoregressive and triforce, beside the floor (the weights once a step, every
    sequence's KV)."""
    py, jl = sys.executable, str(out / "d.jsonl")
    gd = [py, "benchmarks/gpu_decode.py", "--out", jl, "--modes", "graphed", "triforce"]
    if smoke:
        gd += ["--device", "cpu", "--layers", "2", "--new-tokens", "4", "--copy-mib", "16", "--threads", "1",
               "--budget", "64"]
        return [("batch smollm2", [*gd, "--geometry", "smollm2", "--contexts", "256", "--batch", "1,2"], 240)]
    gd += ["--new-tokens", "64", "--geometry", "llama2-7b"]
    single = [py, "benchmarks/gpu_decode.py", "--out", jl, "--modes", "graphed", "--new-tokens", "64",
              "--geometry", "llama2-7b", "--contexts", "8192", "--repeats", "2"]
    return [("cuda batch tests", [py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
                                  "tests/test_batch.py", "tests/test_triton_linear.py"], 90),
            ("batch llama2-7b 8K", [*gd, "--contexts", "8192", "--batch", "1,4,8,16"], 180),
            ("batch llama2-7b 32K", [*gd, "--contexts", "32768", "--batch", "1,4"], 110),
            # what the row-exact projections cost a single stream: the same decode on cuBLAS
            ("decode llama2-7b 8K cublas", ["env", "TRIFORCE_OFFLOAD_GPU_LINEAR=cublas", *single], 70)]


def stage_b(out: Path, smoke: bool, model: str) -> list[tuple[str, list[str], int]]:
    """(name, argv, timeout_s) of the second call."""
    py, jl = sys.executable, str(out / "b.jsonl")
    op = [py, "benchmarks/offload_pipeline.py", "--out", jl, "--repeats", "2"]
    gd = [py, "benchmarks/gpu_decode.py", "--out", jl, "--model", model, "--prompt-text", "essays",
          "--modes", "graphed", "triforce", "--repeats", "2"]
    bench = [*cli(), "bench", *(["--model", model] if model != "bundled" else []), "--out", str(out / "bench"), "--no-plots",
             "--modes", "autoregressive+offload,retrieval+offload,triforce+offload", "--gamma2", "6"]
    if smoke:
        op += ["--device", "cpu", "--layers", "2", "--link-mib", "16", "--threads", "1"]
        gd += ["--device", "cpu", "--contexts", "256", "--new-tokens", "4", "--copy-mib", "16", "--threads", "1"]
        bench += ["--device", "cpu", "--contexts", "512", "--new-tokens", "4", "--threads", "1", "--budget", "128"]
        return [("offload smollm2", [*op, "--geometry", "smollm2", "--contexts", "256", "--chunk", "64"], 120),
                ("decode real", gd, 120), ("bench offload", bench, 180)]
    op += ["--device", "cuda"]
    gd += ["--contexts", "32768", "--new-tokens", "128", "--budget", "4096", "--rope-scaling", "linear:4"]
    bench += ["--device", "cuda", "--dtype", "bfloat16", "--contexts", "32768", "--new-tokens", "128",
              "--budget", "4096", "--rope-scaling", "linear:4"]
    return [("offload llama2-7b 16K", [*op, "--geometry", "llama2-7b", "--contexts", "16384"], 80),
            ("offload smollm2", [*op, "--geometry", "smollm2", "--contexts", "32768"], 50),
            ("decode real", gd, 80), ("bench offload", bench, 80),
            # last: two 64 GiB host stores one after the other (no --compare: a third would not fit)
            ("offload llama2-7b 128K + prefill", [*op, "--geometry", "llama2-7b", "--contexts", "131072",
                                                  "--no-compare", "--prefill"], 160)]


def run(cmds, log: Path, budget_s: float, dry: bool, skip: dict[str, str] | None = None) -> int:
    """Run the commands in order under one deadline; every output goes to `log` and stdout.
    `skip`: commands not to run, by name, each with the note that says why. Returns the
    number of commands that failed or were skipped for want of time."""
    skip = skip or {}
    if dry:
        print(f"# budget {budget_s:.0f} s; the commands' limits add up to {sum(c[2] for c in cmds)} s")
        for name, argv, limit in cmds:
            why = f"; skipped: {skip[name]}" if name in skip else ""
            print(f"# {name} (timeout {limit} s{why})\n{shlex.join(argv)}")
        return 0
    deadline = time.monotonic() + budget_s
    bad = 0
    with log.open("a") as f:
        def say(text):
            print(text, flush=True)
            f.write(text + "\n")
            f.flush()
        for name, argv, limit in cmds:
            line = shlex.join(argv)
            left = deadline - time.monotonic()
            if name in skip:
                say(f"== {name}: skipped, {skip[name]}\n   {line}")
                continue
            if left < min(MIN_START_S, limit):
                say(f"== {name}: skipped, {left:.0f} s left of the stage's budget\n   {line}")
                bad += 1
                continue
            say(f"== {name}\n$ {line}")
            t0 = time.monotonic()
            try:
                r = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                   timeout=min(limit, left), env={**os.environ, "PYTHONUNBUFFERED": "1"})
                rc = r.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            except FileNotFoundError as e:
                rc = f"not found ({e.filename})"
            bad += rc != 0
            say(f"== {name}: exit {rc}, {time.monotonic() - t0:.0f} s")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("a", "b", "c", "d"))
    ap.add_argument("--model", default="/root/w/smol.gguf",
                    help="the real checkpoint of stage b (`bundled`: the installed SmolLM2)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/gpu_session")
    ap.add_argument("--budget-s", type=float, default=float(BUDGET_S), help="seconds for the whole stage")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--smoke", action="store_true", help="shrunk sizes on the CPU (tests)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if not a.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    cmds = {"a": lambda: stage_a(out, a.smoke), "b": lambda: stage_b(out, a.smoke, a.model),
            "c": lambda: stage_c(out, a.smoke), "d": lambda: stage_d(out, a.smoke)}[a.stage]()
    skip = {}
    if a.stage == "b" and a.model != "bundled" and not Path(a.model).exists():
        # the geometry commands need no checkpoint: run them, and say why the others did not
        note = (f"model {a.model} not found (env.sh joins .gpu/a/part and .gpu/b/part into "
                "/root/w/smol.gguf when both halves reached the same machine)")
        skip = {name: note for name, _, _ in cmds if name in REAL}
        print(f"gpu_session: {note}; skipping {', '.join(skip)}", file=sys.stderr)
    bad = run(cmds, out / f"{a.stage}.log", a.budget_s, a.dry_run, skip)
    if not a.dry_run:
        skipped = f", {len(skip)} skipped without the model" if skip else ""
        print(f"stage {a.stage}: {len(cmds) - len(skip) - bad}/{len(cmds)} commands succeeded{skipped}; "
              f"logs in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
