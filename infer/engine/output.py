"""A step's tokens into its requests: appending sampled and verified tokens, stopping (stop ids, stop strings,
length) and the generated text."""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from infer.engine.request import Request


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, max_model_len: int,
                 on_finish: Callable[[Request], None]) -> None:
        """on_finish: called with each request that stops, once its pages are freed (its drafter state goes too)."""
        self.tokenizer, self.max_model_len, self.on_finish = tokenizer, max_model_len, on_finish

    def append(self, request: Request, token: int, settle: bool = False) -> bool:
        """Record a sampled token and decide whether the request stops; frees its pages when it does.

        settle: the token follows a verified position, so everything before it is now in the cache.
        """
        if settle:
            request.num_computed = request.num_tokens
        request.output_ids.append(token)
        request.token_ids.append(token)
        params = request.params
        if token in request.stop_ids:
            request.finish_reason = "stop"
        elif params.stop and self._hit_stop_string(request):
            request.finish_reason = "stop"
        elif len(request.output_ids) >= params.max_new_tokens or request.num_tokens >= self.max_model_len:
            request.finish_reason = "length"
        return request.finish_reason is not None and self._finish(request)

    def append_verified(self, request: Request, tokens: list[int]) -> bool:
        """`append(request, token, settle=True)` for each of a verify step's emitted tokens in turn, up to the first
        that stops the request, in one pass (a speculating step settles some B * tau tokens; the stop strings alone
        need the text after every token)."""
        if request.params.stop:
            return any(self.append(request, token, settle=True) for token in tokens)
        # the last token kept: the first stop token, or the one that reaches a length limit (a stop wins a tie)
        room = max(1, min(request.params.max_new_tokens - len(request.output_ids),
                          self.max_model_len - request.num_tokens))
        stop = next((j for j, token in enumerate(tokens) if token in request.stop_ids), len(tokens))
        last = min(stop, room - 1, len(tokens) - 1)
        kept = tokens[: last + 1]
        request.num_computed = request.num_tokens + last  # every position before the last kept token is settled
        request.output_ids.extend(kept)
        request.token_ids.extend(kept)
        if last == stop:
            request.finish_reason = "stop"
        elif last == room - 1:
            request.finish_reason = "length"
        return request.finish_reason is not None and self._finish(request)

    def _finish(self, request: Request) -> bool:
        """A request that just stopped: its time, pages, drafter state and text. True."""
        request.finish_time = time.perf_counter()
        request.page_table.free()
        self.on_finish(request)
        if self.tokenizer is not None and not request.stopped_by_string:
            request.text = self._output_text(request)
        return True

    def _output_text(self, request: Request) -> str:
        """The generated text as it reads after the prompt (decoded together: a leading space survives)."""
        decode = self.tokenizer.decode
        if request.prompt_text_decoded is None:
            request.prompt_text_decoded = decode(request.prompt_ids, skip_special_tokens=True)
        full = decode(request.token_ids, skip_special_tokens=True)
        prefix = request.prompt_text_decoded
        return full[len(prefix):] if full.startswith(prefix) else decode(request.output_ids, skip_special_tokens=True)

    def _hit_stop_string(self, request: Request) -> bool:
        text = self._output_text(request) if self.tokenizer else ""
        hits = [i for i in (text.find(s) for s in request.params.stop) if i >= 0]
        if hits:
            request.text = text[: min(hits)]
            request.stopped_by_string = True
        return bool(hits)
