"""The OpenAI API's request bodies as pydantic models, and its error body.

Fields the server does not implement are refused with a 400 naming them (unknown ones, and OpenAI ones set to
anything but their no-op value), never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

# OpenAI fields this server does not implement, with the values that mean "off" (accepted, as clients send them)
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None,),
    "functions": (None, []), "parallel_tool_calls": (None,),
}


class ServingError(ValueError):
    """A request the server refuses: an OpenAI error body with this status, naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.headers = message, param, status, kind, headers

    def response(self) -> JSONResponse:
        return error_response(self.message, self.param, self.status, self.kind, self.headers)


def error_response(message: str, param: str | None, status: int, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Sampling(BaseModel):
    """What completions and chat completions share; other fields are kept (extra) for `refuse_unsupported`."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=64)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # not OpenAI's; vLLM's extra, sent through the client's extra_body
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extra: generate max_tokens tokens whatever the model says
    user: str | None = None

    def refuse_unsupported(self) -> None:
        """Raise ServingError naming the first field this server does not implement: an unknown one, or an OpenAI
        one (UNSUPPORTED) set to anything but its no-op value."""
        for name, value in (self.model_extra or {}).items():
            off = UNSUPPORTED.get(name)
            if off is None:
                raise ServingError(f"unsupported parameter {name}: this server does not know it", name)
            if value is not None and not any(value == v and type(value) is type(v) for v in off):
                raise ServingError(f"unsupported parameter {name}={value!r}: this server does not implement it", name)

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stop if s)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage in every chunk (a load generator counts tokens)."""
        return bool((self.stream_options or {}).get("continuous_usage_stats"))


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one text, one list of ids, or a batch of either."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text: its string, or its text parts joined (OpenAI's content parts)."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported, only 'text'")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
