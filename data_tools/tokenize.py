"""Conversations -> token ids with a loss mask on assistant tokens only; truncation; packing under a token budget.

The conversation is rendered to text with the target's chat template (`apply_chat_template`), or, for base
models without one (stories260K), with `PLAIN_TEMPLATE`: BOS, the turns' contents concatenated, and an end
token after a final assistant turn (stories260K ends a story with BOS, so its config sets end_token "<s>").
Every message's content is then located in the rendered text, in order, and the text is tokenized once with
character offsets: a token is in the loss mask when its characters overlap an assistant message's content, or
the special token (end of turn) that directly follows it. Tokenizing the whole text once keeps the ids exactly
those the target sees; masking by offsets cannot drift the way per-turn tokenization does.

Special tokens the template writes (`<s>`, `<|eot_id|>`, ...) always become their ids (`split_special_tokens=False`
on every call), whatever the tokenizer's own setting: the stories260K converter sets split_special_tokens=True so
that a user's literal "<s>" stays text, as in llama2.c, which would otherwise turn the template's BOS and end token
into the pieces `< s >` and give records that never contain the id the target was trained on.

loss_mask[i] = 1 means token i is an assistant token, a token the draft head should learn to predict (from the
features at position i - 1); the trainer does the shift.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from data_tools.conversations import Conversation, DataError, LoadReport

PLAIN = "plain"
# Base-model template: no role markers; `end_token` (a template variable) closes a final assistant turn.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if messages and messages[-1]['role'] == 'assistant' %}{{ end_token }}{% endif %}"
)


@dataclass
class TokenizedRecord:
    source: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens

    def __len__(self) -> int:
        return len(self.input_ids)


class _Skip(Exception):
    def __init__(self, reason: str, detail: str, policy: bool = True) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.policy = reason, detail, policy


@dataclass
class ChatFormat:
    """How conversations become tokens for one target.

    chat_template: None uses the tokenizer's own template; "plain" the base-model template; else a Jinja string.
    end_token: closes a final assistant turn in the plain template and ends plain-text records
               (default: the tokenizer's eos token).
    max_length: records longer than this are truncated (truncate=True) or treated as bad records ("too_long").
    """

    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None = None
    end_token: str | None = None
    max_length: int = 2048
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.chat_template == PLAIN:
            self.chat_template = PLAIN_TEMPLATE
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                "the tokenizer has no chat template: set chat_template=plain for a base model (or give a Jinja template)"
            )
        if self.end_token is None:
            self.end_token = self.tokenizer.eos_token or ""
        if self.max_length < 1:
            raise DataError(f"max_length must be >= 1, got {self.max_length}")
        specials = set(self.tokenizer.all_special_tokens) | {
            t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values() if t.special
        }
        # Longest first, so that a special token that is a prefix of another never wins.
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)

    # --- rendering --------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template, end_token=self.end_token,
            )
        except Exception as err:  # jinja raises its own errors (e.g. "roles must alternate") as TemplateError
            raise _Skip("template_error", f"the chat template rejects this conversation: {err}") from err

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the conversation so far plus the generation prompt: what the target continues."""
        text = self.render(messages, add_generation_prompt=True)
        return self._encode(text)["input_ids"]

    def _encode(self, text: str, **kwargs) -> dict:
        """Rendered text -> ids, the template's special tokens as their ids (module docstring)."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=False, **kwargs)

    def _render_with_spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans [start, end) that carry loss."""
        if conversation.kind == "text":
            bos = self.tokenizer.bos_token or ""
            text = bos + conversation.text + self.end_token
            return text, [(len(bos), len(text))]
        if not any(m["role"] == "assistant" for m in conversation.messages):
            raise _Skip("no_assistant_turn", "has no assistant turn to train on", policy=False)
        text = self.render(conversation.messages)
        spans, cursor = [], 0
        for i, message in enumerate(conversation.messages):
            content = message["content"]
            start = text.find(content, cursor)
            if start < 0:  # templates often trim contents
                content = content.strip()
                start = text.find(content, cursor)
            if start < 0:
                raise _Skip("template_mismatch", f"message {i} ({message['role']}) not found in the rendered template")
            end = start + len(content)
            cursor = end
            if message["role"] == "assistant":
                spans.append((start, self._after_end_of_turn(text, end)))
        return text, spans

    def _after_end_of_turn(self, text: str, end: int) -> int:
        """Extend an assistant span over the special token that closes it (</s>, <|im_end|>, <|eot_id|>, ...)."""
        for special in self._specials:
            if text.startswith(special, end):
                return end + len(special)
        return end

    # --- tokenization -----------------------------------------------------------------------------
    def tokenize(self, conversation: Conversation) -> tuple[TokenizedRecord, bool]:
        """(record, truncated); raises _Skip for a record that cannot be used."""
        text, spans = self._render_with_spans(conversation)
        encoded = self._encode(text, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        truncated = len(ids) > self.max_length
        if truncated:
            if not self.truncate:
                raise _Skip("too_long", f"{len(ids)} tokens > max_length {self.max_length} (truncate=false)")
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not mask.any():
            raise _Skip("no_assistant_tokens", "no assistant token within max_length", policy=False)
        return TokenizedRecord(conversation.source, list(ids), mask.astype(np.uint8).tolist()), truncated

    def tokenize_all(
        self, conversations: list[Conversation], report: LoadReport, progress: bool = True
    ) -> list[TokenizedRecord]:
        """Tokenize in order; records that cannot be used are counted in `report` (or fail, per its policy)."""
        records = []
        bar = tqdm(conversations, desc="tokenize", unit="rec", disable=not progress, dynamic_ncols=True)
        tokens = 0
        for conversation in bar:
            try:
                record, truncated = self.tokenize(conversation)
            except _Skip as skip:
                report.bad_record(conversation.source, skip.reason, skip.detail, policy=skip.policy)
                continue
            report.truncated += truncated
            records.append(record)
            tokens += len(record)
            bar.set_postfix(tokens=tokens, refresh=False)
        report.kept = len(records)
        return records


def pack_by_budget(lengths: list[int], max_tokens: int, max_records: int | None = None) -> list[list[int]]:
    """Group indices, in the given order, into batches of at most max_tokens tokens (and max_records records).

    A record longer than the budget gets a batch of its own. Batches are variable-length packs, not padded
    rows: each record stays its own sequence (no attention across records).
    """
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        full = used + n > max_tokens or (max_records is not None and len(current) >= max_records)
        if current and full:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches
