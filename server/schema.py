"""OpenAI request bodies (pydantic) and OpenAI-shaped errors.

Fields we do not implement but that change the output when set (n > 1, logprobs,
penalties, echo, tools) are refused rather than silently ignored; unknown fields are
ignored as OpenAI-compatible servers do.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    """A request the server answers with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the usage and no choices


class Request(BaseModel):
    """What /v1/chat/completions and /v1/completions share."""
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None  # must name the served model when given
    max_tokens: Optional[int] = None  # default: the server's --max-new-tokens
    # NaN passes no bound, so it is refused first ("a finite number", not "<= 2")
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)  # default: --temperature
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=0)  # an extension (vLLM, llama.cpp); 0 keeps all
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 64)  # what torch's generators take
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def refused(self) -> tuple[str, str] | None:
        """(param, why) of a field set to something this server does not do."""
        if self.n != 1:
            return "n", "n must be 1: one completion per request"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not supported"
        if getattr(self, "logprobs", None):
            return "logprobs", "logprobs are not supported"
        return None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise ApiError(400, "at most 4 stop sequences", "stop")
        return [s for s in stops if s]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        """The content as text (parts of type text joined); other parts are refused."""
        if not isinstance(self.content, list):
            return self.content or ""
        if any(p.get("type") != "text" for p in self.content):
            raise ApiError(400, "only text content parts are supported", "messages")
        return "".join(str(p.get("text", "")) for p in self.content)


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None  # the newer name of max_tokens
    logprobs: Optional[bool] = None
    tools: Optional[list] = None

    def refused(self):
        if self.tools:
            return "tools", "tools are not supported"
        return super().refused()


class CompletionRequest(Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def refused(self):
        if self.echo or self.suffix or (self.best_of or 1) > 1:
            return "echo", "echo, suffix and best_of are not supported"
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                return "prompt", "one prompt per request (a list of several is a batch)"
        return super().refused()

    def single(self) -> Union[str, list[int]]:
        """The prompt as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]
        if not p:
            raise ApiError(400, "the prompt is empty", "prompt")
        return p
