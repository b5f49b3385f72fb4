"""Models by name: `--model org/name` (an HF folder: config, tokenizer, safetensors),
`org/name@revision`, and for a GGUF repository `org/name:QUANT` (the file whose name
carries that quantization) or `org/name/file.gguf`, resolved through huggingface_hub's cache
(`$HF_HOME/hub`, `models--org--name/snapshots/<rev>/`), as transformers, vLLM and
llama.cpp's `-hf` take them.

What is in the cache is used without the network. What is missing is downloaded only when
the hub may be reached (`HF_HUB_OFFLINE` unset); otherwise one line says the model is not
in the cache and how to get it. A path that exists always wins over a hub id of the same
spelling (`loader.model_path` asks here only for paths that do not exist).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import TriforceError

_PART = r"[A-Za-z0-9][\w.-]*"
HUB_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:/(?P<file>[^@:]+\.gguf))?"
                    rf"(?:@(?P<rev>[\w./-]+))?(?::(?P<quant>[\w.-]+))?$")
SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")  # a model split into several files
HF_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]  # an HF folder's


@dataclass
class HubId:
    repo: str  # org/name
    revision: str | None = None  # a branch, tag or commit; None: main
    quant: str | None = None  # the quantization a GGUF file's name carries (Q4_K_M)
    file: str | None = None  # a GGUF file of the repository

    def __str__(self) -> str:
        return self.repo + (f"/{self.file}" if self.file else "") + \
            (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")


def parse(text: str) -> HubId | None:
    """The hub id `text` spells, or None where it is no hub id (a path)."""
    if text.startswith((".", "/", "~")) or "\\" in text:
        return None
    m = HUB_ID.match(text)
    return HubId(m["repo"], m["rev"], m["quant"], m["file"]) if m else None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    """huggingface_hub's cache folder, read from the environment now (its own
    `constants.HF_HUB_CACHE` is fixed when it is first imported)."""
    return os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")


def resolve(hid: HubId) -> Path:
    """A local HF folder or GGUF file for `hid`, from the cache or downloaded."""
    try:
        if hid.quant or hid.file:
            return _gguf(hid)
        return _folder(hid)
    except TriforceError:
        raise
    except Exception as e:  # huggingface_hub's errors: not cached, unknown repo, no network
        raise TriforceError(missing(hid, e)) from None


def missing(hid: HubId, e: BaseException) -> str:
    why = (str(e).splitlines() or [""])[0] or type(e).__name__
    where = f"in the Hugging Face cache ({cache_dir()})"
    if offline():
        return (f"model {str(hid)!r} is not {where} and HF_HUB_OFFLINE is set: download it where the hub "
                f"is reachable (`huggingface-cli download {hid.repo}`) or pass a path")
    return f"model {str(hid)!r} is neither a path nor {where}, and the hub did not give it: {why}"


def _folder(hid: HubId) -> Path:
    from huggingface_hub import snapshot_download
    d = Path(snapshot_download(hid.repo, revision=hid.revision, allow_patterns=HF_FILES,
                               local_files_only=offline(), cache_dir=cache_dir()))
    if not (d / "config.json").exists():
        ggufs = sorted(p.name for p in d.glob("*.gguf"))
        hint = f"; it holds GGUF files: name one as {hid.repo}:QUANT" if ggufs else ""
        raise TriforceError(f"model {str(hid)!r} has no config.json{hint}")
    return d


def _gguf(hid: HubId) -> Path:
    from huggingface_hub import hf_hub_download
    name = hid.file or _pick(hid, _gguf_files(hid))
    return Path(hf_hub_download(hid.repo, name, revision=hid.revision, local_files_only=offline(),
                                cache_dir=cache_dir()))


def _gguf_files(hid: HubId) -> list[str]:
    """The repository's GGUF files: its snapshot in the cache when offline, else the hub's list."""
    if offline():
        from huggingface_hub import snapshot_download
        d = Path(snapshot_download(hid.repo, revision=hid.revision, local_files_only=True,
                                   cache_dir=cache_dir()))
        return sorted(str(p.relative_to(d)) for p in d.rglob("*.gguf"))
    from huggingface_hub import HfApi
    return sorted(f for f in HfApi().list_repo_files(hid.repo, revision=hid.revision) if f.endswith(".gguf"))


def quant_of(name: str) -> str | None:
    """The quantization a GGUF file's name carries (Q4_K_M, IQ3_XS, F16, BF16), or None."""
    m = re.search(r"(?i)(?:^|[-._])((?:I?Q\d+(?:_[A-Z0-9]+)*)|F16|BF16|F32)(?=[-._])", Path(name).name)
    return m[1].upper() if m else None


def _pick(hid: HubId, files: list[str]) -> str:
    hits = [f for f in files if (quant_of(f) or "") == hid.quant.upper()]
    have = sorted({q for q in map(quant_of, files) if q})
    if not hits:
        raise TriforceError(f"{hid.repo} has no GGUF file of quantization {hid.quant}; it has "
                            f"{', '.join(have) if have else 'no GGUF files'}")
    if len(hits) > 1:
        what = "is split into several files" if all(SHARD.search(f) for f in hits) else "matches several files"
        raise TriforceError(f"{hid.repo}:{hid.quant} {what} ({', '.join(hits)}); name one as "
                            f"{hid.repo}/FILE.gguf (a split model is not supported)")
    return hits[0]
