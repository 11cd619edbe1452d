"""A completion or chat completion from body to response: checks that name the field, the engine requests (one per
prompt and choice), and the answer, whole or as server-sent events.

Streamed text is decoded incrementally (`ChoiceText`) and held back where it could still change (a partial
character, or what may be the start of a stop string); the last chunk brings the rest of the engine's own text, so
the chunks add up to the non-streamed text.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import PreTrainedTokenizerBase

from infer.engine import Engine
from infer.sampling_params import SamplingParams
from infer.serve.engine_loop import EngineLoop, QueueFull, Stream, Update
from infer.serve.protocol import ChatCompletionRequest, CompletionRequest, ServingError

# SamplingParams' and the engine's words for a field -> the OpenAI field a client set
_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "seed": "seed", "stop": "stop", "a": "max_tokens"}
RETRY_AFTER_S = 1


@dataclass
class Served:
    """What the handlers share: the engine (its configuration only), its loop thread and the model's name."""

    engine: Engine
    loop: EngineLoop
    model_name: str
    tokenizer: PreTrainedTokenizerBase = field(init=False)

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer


def chat_prompt_ids(served: Served, body: ChatCompletionRequest) -> list[int]:
    """The conversation through the model's chat template (transformers'), as token ids."""
    template = getattr(served.tokenizer, "chat_template", None)
    if not template:
        raise ServingError(f"model {served.model_name!r} has no chat template (its tokenizer_config.json has no "
                           "chat_template): use /v1/completions with a prompt", "messages")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template's own error, about these messages
        raise ServingError(f"the chat template cannot render these messages: {err}", "messages") from err
    return served.tokenizer.encode(text, add_special_tokens=False)


def completion_prompt_ids(served: Served, body: CompletionRequest) -> list[list[int]]:
    prompts = body.prompts()
    if not prompts:
        raise ServingError("prompt is empty", "prompt")
    return [served.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]


def engine_requests(served: Served, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                    prompt_field: str, sink: asyncio.Queue) -> list[Stream]:
    """One stream per prompt and choice, checked as the engine would check them (ServingError naming the field)."""
    if body.model != served.model_name:
        raise ServingError(f"model {body.model!r} does not exist: this server serves {served.model_name!r}", "model")
    body.refuse_unsupported()
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    loop, streams = asyncio.get_running_loop(), []
    for i, prompt_ids in enumerate(prompts):
        for j in range(body.n):
            params = SamplingParams(
                temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                max_new_tokens=max_tokens or max(1, served.engine.max_model_len - len(prompt_ids)),
                seed=None if body.seed is None else body.seed + j, stop=body.stop_strings(), ignore_eos=body.ignore_eos,
            )
            try:
                served.engine.check_request(prompt_ids, params)
            except ValueError as err:
                word = str(err).split()[0]
                param = prompt_field if word in ("prompt", "the") else _FIELDS.get(word.rstrip(","), None)
                raise ServingError(str(err).replace("max_new_tokens", "max_tokens"), param) from err
            streams.append(Stream(i * body.n + j, prompt_ids, params, sink, loop, incremental=body.stream))
    return streams


def submit(served: Served, streams: list[Stream]) -> None:
    try:
        served.loop.submit(streams)
    except QueueFull as err:
        raise ServingError(f"the server is busy ({err}): retry later", None, 429, "rate_limit_error",
                           {"Retry-After": str(RETRY_AFTER_S)}) from err
    if not served.loop.alive:
        raise ServingError("the engine loop has stopped; see the server's log", None, 503, "server_error")


class ChoiceText:
    """One choice's text as its tokens arrive: the part safe to send now, and the rest at the end.

    Decoded incrementally as vLLM's detokenizer does: a few tokens before the new ones are decoded with and without
    them, and the difference is the new text (decoding the whole sequence every step costs O(length) per token)."""

    WINDOW = 6  # tokens decoded before the new ones, so a word's leading space comes out as in the whole text

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stream: Stream) -> None:
        self.tokenizer, self.stream = tokenizer, stream
        self.all_ids = list(stream.prompt_ids)
        self.prefix_offset, self.read_offset = max(len(self.all_ids) - self.WINDOW, 0), len(self.all_ids)
        self.ids: list[int] = []
        self.text = ""  # decoded so far
        self.sent = ""
        self.hold = max((len(s) for s in stream.params.stop), default=1) - 1

    def _decode_new(self) -> None:
        prefix = self.tokenizer.decode(self.all_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.all_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # else a character's bytes have not all come
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = max(self.read_offset, len(self.all_ids) - self.WINDOW), len(
                self.all_ids)

    def delta(self, update: Update) -> str:
        """The text to send for this update."""
        self.ids.extend(update.new_ids)
        self.all_ids.extend(update.new_ids)
        if update.finish_reason is not None:
            final = update.text or ""
            new = final[len(self.sent):] if final.startswith(self.sent) else ""
        else:
            self._decode_new()
            text = self.text
            for stop in self.stream.params.stop:  # never send a stop string, nor what may begin one
                cut = text.find(stop)
                text = text if cut < 0 else text[:cut]
            text = text[: len(text) - self.hold] if self.hold else text
            new = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += new
        return new


async def run(served: Served, raw: HTTPRequest, body: CompletionRequest | ChatCompletionRequest,
              prompts: list[list[int]], chat: bool) -> JSONResponse | StreamingResponse:
    """Queue the request's choices and answer them, whole or streamed; a client that leaves cancels them."""
    sink: asyncio.Queue = asyncio.Queue()
    streams = engine_requests(served, body, prompts, "messages" if chat else "prompt", sink)
    submit(served, streams)
    reply = Reply(served, body, prompts, streams, chat)
    if body.stream:
        return StreamingResponse(reply.events(sink), media_type="text/event-stream")
    try:
        while reply.open:
            try:
                reply.take(await asyncio.wait_for(sink.get(), timeout=0.5))
            except asyncio.TimeoutError:
                if await raw.is_disconnected():
                    break
    finally:
        served.loop.cancel(streams)
    if reply.error:
        raise ServingError(reply.error, None, 500, "server_error")
    return JSONResponse(reply.whole())


class Reply:
    """The response to one HTTP request: its choices' texts, finish reasons and usage."""

    def __init__(self, served: Served, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                 streams: list[Stream], chat: bool) -> None:
        self.served, self.body, self.chat, self.streams = served, body, chat, streams
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.texts = [ChoiceText(served.tokenizer, s) for s in streams]
        self.parts: list[list[str]] = [[] for _ in streams]
        self.finish: list[str | None] = [None] * len(streams)
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.error: str | None = None
        self.open = len(streams)

    def take(self, update: Update) -> str:
        """Record an update; returns the text it adds."""
        if update.error is not None:
            self.error = self.error or update.error
        text = self.texts[update.index].delta(update)
        self.parts[update.index].append(text)
        if update.finish_reason is not None:
            self.finish[update.index] = update.finish_reason
            self.open -= 1
        return text

    def usage(self) -> dict:
        completion = sum(len(t.ids) for t in self.texts)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _choice(self, index: int, text: str, finish: str | None, first: bool = False, whole: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if whole:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served.model_name,
                "choices": choices}

    def whole(self) -> dict:
        choices = [self._choice(i, "".join(p), f, whole=True) for i, (p, f) in enumerate(zip(self.parts, self.finish))]
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    async def events(self, sink: asyncio.Queue) -> AsyncIterator[str]:
        """Server-sent events: a chunk per choice for the updates that arrived since the last one (one a step while
        the client keeps up; fewer, larger chunks when it falls behind), then usage if asked, [DONE]. A client that
        disconnects cancels this generator, and its `finally` aborts the requests."""
        started = [False] * len(self.streams)
        try:
            while self.open:
                updates = [await sink.get()]
                while not sink.empty():
                    updates.append(sink.get_nowait())
                texts: dict[int, str] = {}
                finish: dict[int, str | None] = {}
                for update in updates:
                    texts[update.index] = texts.get(update.index, "") + self.take(update)
                    finish[update.index] = update.finish_reason
                    if update.error is not None:
                        yield _sse({"error": {"message": update.error, "type": "server_error", "param": None,
                                              "code": 500}})
                for index, text in texts.items():
                    if (not text and finish[index] is None and started[index]) or finish[index] == "error":
                        continue
                    choice = self._choice(index, text, finish[index], first=not started[index])
                    started[index] = True
                    chunk = self._envelope([choice], chunk=True)
                    if self.body.continuous_usage:
                        chunk["usage"] = self.usage()
                    yield _sse(chunk)
            if self.body.include_usage:
                yield _sse({**self._envelope([], chunk=True), "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:
            self.served.loop.cancel(self.streams)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
