"""Load conversations from ShareGPT, OpenAI-messages, plain-text and prompt-set files, validating every record.

Accepted records (one format may be mixed with another in the same file):
  ShareGPT      {"conversations": [{"from": "human" | "gpt" | "system", "value": str}, ...]}
  messages      {"messages": [{"role": "user" | "assistant" | "system", "content": str}, ...]}
  plain text    {"text": str}                       every token is trained on (base-model data)
  prompt sets   {"turns": [str, ...]}               MT-bench / Spec-Bench questions: user turns only
Files: .json (a list of records), .jsonl (one record a line), or a folder written by `datasets.save_to_disk`.

A malformed record is either skipped and counted or fails the run (`on_error`); either way its location
(file:line for JSONL, file[index] otherwise) and the reason are reported. `LoadReport` carries the counts of
what was read, kept and skipped, and why, through every later stage (tokenization adds its own reasons).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Role names seen in ShareGPT dumps and chat APIs -> the chat-template roles.
ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
    "system": "system",
}
ON_ERROR = ("skip", "fail")
MAX_ISSUES_KEPT = 20  # locations kept per reason for the report; the counts are always complete


class DataError(ValueError):
    """A problem with the user's data or options; command lines print it as one line and exit 2."""


@dataclass
class Conversation:
    """One validated record. kind: "chat" (messages with roles), "text" (plain text) or "prompts" (user turns)."""

    source: str  # where it came from: "file:line" or "file[index]"
    kind: str
    messages: list[dict[str, str]] = field(default_factory=list)  # [{"role", "content"}] for chat and prompts
    text: str = ""  # for kind == "text"
    id: str | None = None


@dataclass
class LoadReport:
    """Counts of records read, kept and skipped (by reason), with the first locations of each problem."""

    on_error: str = "skip"
    read: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    issues: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise DataError(f"on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")

    def bad_record(self, source: str, reason: str, detail: str, policy: bool = True) -> None:
        """Count a record that is dropped; with on_error=fail (and `policy`), raise instead."""
        message = f"{source}: {detail}"
        if policy and self.on_error == "fail":
            raise DataError(f"{message} (reason {reason}; on_error=skip skips such records)")
        self.skipped[reason] += 1
        kept = self.issues.setdefault(reason, [])
        if len(kept) < MAX_ISSUES_KEPT:
            kept.append(message)

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(self.skipped.items()))
        line = f"records: read {self.read}, kept {self.kept}, skipped {skipped}"
        if reasons:
            line += f" ({reasons})"
        if self.truncated:
            line += f", truncated {self.truncated}"
        return line

    def details(self, per_reason: int = 3) -> list[str]:
        """The first locations of each kind of problem, for the log."""
        lines = []
        for reason in sorted(self.issues):
            for message in self.issues[reason][:per_reason]:
                lines.append(f"  skipped ({reason}) {message}")
        return lines

    def as_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "truncated": self.truncated,
                "skipped": dict(sorted(self.skipped.items()))}


class _BadRecord(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _BadRecord("content_not_string", f"{where} is {type(value).__name__}, not a string")
    if not value.strip():
        raise _BadRecord("empty_turn", f"{where} is empty")
    return value


def _turns(turns: object, role_key: str, content_key: str, field_name: str) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise _BadRecord("no_turns", f"'{field_name}' is not a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _BadRecord("bad_turn", f"{field_name}[{i}] is not an object")
        role = turn.get(role_key)
        if role not in ROLE_ALIASES:
            raise _BadRecord("unknown_role", f"{field_name}[{i}] has unknown role {role!r}")
        messages.append({"role": ROLE_ALIASES[role], "content": _string(turn.get(content_key), f"{field_name}[{i}].{content_key}")})
    return messages


def parse_record(record: object, source: str) -> Conversation:
    """One raw record -> Conversation; raises _BadRecord naming what is wrong."""
    if not isinstance(record, dict):
        raise _BadRecord("not_an_object", f"record is {type(record).__name__}, not an object")
    record_id = record.get("id", record.get("question_id"))
    record_id = None if record_id is None else str(record_id)
    if "conversations" in record:
        messages = _turns(record["conversations"], "from", "value", "conversations")
        return Conversation(source, "chat", messages, id=record_id)
    if "messages" in record:
        messages = _turns(record["messages"], "role", "content", "messages")
        return Conversation(source, "chat", messages, id=record_id)
    if "text" in record:
        return Conversation(source, "text", text=_string(record["text"], "text"), id=record_id)
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise _BadRecord("no_turns", "'turns' is not a non-empty list")
        messages = [{"role": "user", "content": _string(t, f"turns[{i}]")} for i, t in enumerate(turns)]
        return Conversation(source, "prompts", messages, id=record_id)
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise _BadRecord("unknown_format", f"no 'conversations', 'messages', 'text' or 'turns' field (keys: {keys})")


def _raw_records(path: Path, split: str) -> Iterator[tuple[str, object]]:
    """(source, raw record or _BadRecord) for every record of a file or datasets folder."""
    if path.is_dir():
        try:
            from datasets import DatasetDict, load_from_disk  # noqa: PLC0415 - only folders need datasets
        except ImportError as err:  # pragma: no cover - datasets is a dependency
            raise DataError(f"{path}: reading a datasets folder needs the `datasets` package") from err
        try:
            data = load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as err:
            raise DataError(f"{path} is a folder but not one written by datasets.save_to_disk: {err}") from err
        if isinstance(data, DatasetDict):
            if split not in data:
                raise DataError(f"{path} has splits {', '.join(data)}; no split {split!r}")
            data = data[split]
        for i, record in enumerate(data):
            yield f"{path}[{i}]", record
        return
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{line_no}", json.loads(line)
                except json.JSONDecodeError as err:
                    yield f"{path}:{line_no}", _BadRecord("invalid_json", f"not valid JSON ({err.msg})")
        return
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}); use .jsonl for one record a line") from err
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        for i, record in enumerate(data):
            yield f"{path}[{i}]", record
        return
    raise DataError(f"data file {path}: unsupported extension {path.suffix!r} (use .json, .jsonl or a datasets folder)")


def load_conversations(
    paths: Iterable[str | Path], report: LoadReport | None = None, split: str = "train", limit: int | None = None,
) -> tuple[list[Conversation], LoadReport]:
    """Read and validate every record of `paths`, in order; bad records are skipped or fail per report.on_error."""
    report = report or LoadReport()
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError("no data files given")
    conversations: list[Conversation] = []
    for path in paths:
        for source, raw in _raw_records(path, split):
            if limit is not None and report.read >= limit:
                break
            report.read += 1
            try:
                if isinstance(raw, _BadRecord):
                    raise raw
                conversations.append(parse_record(raw, source))
            except _BadRecord as bad:
                report.bad_record(source, bad.reason, bad.detail)
        if limit is not None and report.read >= limit:
            break
    report.kept = len(conversations)
    return conversations, report
