"""Process groups for tensor parallelism: NCCL with CUDA, gloo otherwise.

Nothing happens at import time. Two ways to get ranks:

- `launch(fn, world, ...)` starts `world` processes itself (multiprocessing spawn), sets
  the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), joins
  the process group, runs `fn` on every rank and returns the per-rank results. A
  watchdog in the parent polls the children: when one dies (signal, crash, error) it
  kills the rest and raises a `TriforceError` naming that rank. Never a hang.
- under `torchrun` the environment is already set; `setup()` joins the group from it.

Only rank 0 writes to stdout/stderr: other ranks are silenced at the file-descriptor
level, and their errors reach the user through the launcher (or torchrun's report).
Collectives carry a timeout (`TRIFORCE_TP_TIMEOUT` seconds, default 300), so even a
rank stuck without dying cannot block the others forever.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import TriforceError
from ...settings import env

GRACE_S = 2.0  # after a first failure, wait this long to find the rank that caused it
POLL_S = 0.1  # watchdog poll interval


def world_size() -> int:
    """Ranks in the job: the process group's size, else $WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def timeout_s() -> float:
    return env("tp_timeout")


def backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def check_devices(world: int, device: str):
    """Before anything starts: --tp >= 1, and on CUDA one device per rank."""
    if world < 1:
        raise TriforceError(f"--tp {world}: must be >= 1")
    want_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if want_cuda and world > 1 and torch.cuda.device_count() < world:
        raise TriforceError(f"--tp {world}: needs {world} CUDA devices, "
                            f"{torch.cuda.device_count()} available (use --device cpu for gloo ranks)")


def rank_device(device: str) -> str:
    """Each rank on its own GPU (cuda:LOCAL_RANK); CPU ranks share the CPU."""
    if world_size() == 1:
        return device
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return f"cuda:{os.environ.get('LOCAL_RANK', rank())}"
    return "cpu" if device == "auto" else device


def setup(world: int, device: str = "cpu") -> int:
    """Join the process group when running as one of `world` ranks; returns this rank.

    A no-op at world size 1. Idempotent (the launcher may have joined already).
    """
    env_world = world_size()
    if env_world != world:
        raise TriforceError(f"--tp {world} but this job has {env_world} ranks "
                            "(WORLD_SIZE); pass --tp equal to torchrun's --nproc-per-node")
    if world == 1:
        return 0
    if not dist.is_initialized():
        dev = rank_device(device)
        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
        dist.init_process_group(backend(dev), timeout=timedelta(seconds=timeout_s()))
    if rank():
        silence()
    return rank()


def silence():
    """Point this process's stdout and stderr at /dev/null (ranks other than 0)."""
    null = os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


@contextmanager
def rank0_first():
    """Rank 0 runs the block first (e.g. converts a GGUF into the shared cache), then the rest."""
    multi = world_size() > 1 and dist.is_initialized()
    if multi and rank():
        dist.barrier()
    yield
    if multi and not rank():
        dist.barrier()


def teardown():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, r: int, world: int, port: int, q, device: str, threads: int | None, args, kwargs):
    """Body of one spawned rank: environment, silence, group, fn, report to the parent."""
    _die_with_parent()
    os.environ.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if threads:
        torch.set_num_threads(threads)
    if r:
        silence()
    try:
        setup(world, device)
        q.put((r, True, fn(*args, **kwargs)))
    except BaseException as e:  # report every failure, including KeyboardInterrupt
        q.put((r, False, _one_line(e)))
        q.close()
        q.join_thread()
        os._exit(2 if isinstance(e, TriforceError) else 1)
    teardown()


def _die_with_parent():
    """Linux: the kernel kills this rank if the launcher dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _one_line(e: BaseException) -> str:
    if isinstance(e, TriforceError):
        return str(e)
    last = traceback.format_exception_only(type(e), e)[-1].strip()
    return last.splitlines()[0][:500]


def launch(fn, world: int, args: tuple = (), kwargs: dict | None = None, device: str = "cpu",
           threads: int | None = None, timeout: float | None = None) -> list:
    """Run fn(*args, **kwargs) on `world` spawned ranks; returns [result of rank 0, 1, ...].

    `fn` must be importable by name (module level) and should return plain Python data.
    `threads` sets torch threads per rank. Raises TriforceError naming the rank when any
    rank fails or dies, after killing the others; `timeout` (seconds) bounds the whole run.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, q, device, threads, args, kwargs or {}))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _watch(procs, q, timeout)
    finally:
        _stop(procs)


def _watch(procs, q, timeout):
    """Collect results until every rank reported; on the first failure find the culprit."""
    results, errors, t0, failed_at = {}, {}, time.monotonic(), None
    while len(results) < len(procs):
        _drain(q, results, errors, POLL_S)
        dead = {r for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
        if (errors or dead) and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and (time.monotonic() - failed_at > GRACE_S
                                      or len(errors) + len(dead - set(errors)) == len(procs)):
            raise TriforceError(_culprit(procs, errors))
        if timeout and time.monotonic() - t0 > timeout:
            raise TriforceError(f"tensor-parallel run exceeded {timeout:.0f} s; ranks stopped")
        lost = [r for r, p in enumerate(procs) if p.exitcode == 0 and r not in results]
        if lost and not _drain(q, results, errors, POLL_S):
            raise TriforceError(f"tensor-parallel rank {lost[0]} exited without a result")
    return [results[r] for r in range(len(procs))]


def _drain(q, results, errors, wait) -> bool:
    got = False
    try:
        while True:
            r, ok, payload = q.get(timeout=wait)
            (results if ok else errors)[r] = payload
            got, wait = True, 0.01
    except queue.Empty:
        return got


def _culprit(procs, errors) -> str:
    """A rank that died without a word (killed, crashed) caused the others' errors."""
    silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]
    if silent:
        r = silent[0]
        return f"tensor-parallel rank {r} died ({_exit_reason(procs[r].exitcode)}); stopped the other ranks"
    r = min(errors)
    if "timed out" in errors[r].lower():
        return (f"tensor-parallel rank {r} waited over {timeout_s():.0f} s for another rank "
                f"(TRIFORCE_TP_TIMEOUT): {errors[r]}")
    return f"tensor-parallel rank {r} failed: {errors[r]}"


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs):
    """Terminate ranks still running (ours only), then make sure they are gone."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(3)
        if p.is_alive():
            p.kill()
            p.join(3)
