"""`run --tp N`: start the tensor-parallel ranks and join them (the sharding itself is
`runtime/model/tp.py`, the process groups `runtime/model/distributed.py`)."""
from __future__ import annotations

import torch

from ..runtime.model import distributed
from ..runtime.model import tp as tensor_parallel
from ..runtime.spec.drafters import check_vocab
from ..runtime.model.loader import load_tokenizer, peek_tokenizer, read_config, resolve


def launch_ranks(fn, world: int, model, draft, kwargs: dict) -> bool:
    """In the first process (not yet a rank, not under torchrun): check --tp against the
    model (ModelOptions) and the devices, run fn(**kwargs) on `world` spawned ranks and
    return True. Returns False where the caller itself is to run (world 1, or already a rank).
    """
    distributed.check_devices(world, model.device)
    if world == 1 or distributed.world_size() > 1:
        return False
    target = resolve(model.model)  # converts a GGUF once, here
    tensor_parallel.check(read_config(target, model.rope_scaling), world)
    if draft_path(draft):  # a draft GGUF too, before ranks would convert it at once
        check_vocab(load_tokenizer(target), peek_tokenizer(draft))  # and a mismatch before that
        resolve(draft)
    threads = max(1, torch.get_num_threads() // world)  # one share of the cores per rank
    distributed.launch(fn, world, kwargs=kwargs, device=model.device, threads=threads)
    return True


def join(world: int, device: str, model_path=None, draft=None) -> str:
    """In a rank: join the group, let rank 0 convert the models first; this rank's device."""
    distributed.setup(world, device)
    if world > 1:
        with distributed.rank0_first():
            resolve(model_path)
            if draft_path(draft):
                resolve(draft)
    return distributed.rank_device(device)


def draft_path(draft) -> bool:
    """Whether --draft names a model (n-gram and self drafts have none to load)."""
    return draft not in (None, "ngram", "self")
