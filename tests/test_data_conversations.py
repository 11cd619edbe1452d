"""Loading conversations: the formats, prompt sets, and the treatment of every kind of bad record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_tools.conversations import DataError, LoadReport, load_conversations
from data_tools.tokenize import ChatFormat


def write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_sharegpt_sample_loads(assets_dir: Path) -> None:
    path = assets_dir / "eval" / "fastchat_dummy_conversation.json"
    conversations, report = load_conversations([path])
    assert (report.read, report.kept, sum(report.skipped.values())) == (500, 500, 0)
    first = conversations[0]
    assert first.id == "identity_0" and first.source == f"{path}[0]" and first.kind == "chat"
    assert [m["role"] for m in first.messages] == ["user", "assistant", "user", "assistant"]
    assert first.messages[0]["content"] == "Who are you?"
    assert report.summary() == "records: read 500, kept 500, skipped 0"


def test_messages_jsonl_text_and_datasets_folder(tmp_path: Path) -> None:
    messages = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello!"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [messages, {"text": "Once upon a time."}])
    conversations, report = load_conversations([path])
    assert report.kept == 2 and conversations[0].messages == messages["messages"]
    assert conversations[1].kind == "text" and conversations[1].source == f"{path}:2"

    from datasets import Dataset  # noqa: PLC0415

    folder = tmp_path / "ds"
    Dataset.from_list([messages, messages]).save_to_disk(str(folder))
    conversations, report = load_conversations([folder])
    assert report.kept == 2 and conversations[1].source == f"{folder}[1]"
    assert conversations[1].messages == messages["messages"]


@pytest.mark.parametrize("name", ["mt_bench_question.jsonl", "spec_bench_question.jsonl"])
def test_prompt_sets(assets_dir: Path, name: str) -> None:
    """MT-bench / Spec-Bench question files read as user-turn-only conversations."""
    prompts, _ = load_conversations([assets_dir / "eval" / name])
    assert len(prompts) == 80 if name.startswith("mt") else len(prompts) == 480
    assert all(p.kind == "prompts" and all(m["role"] == "user" for m in p.messages) for p in prompts)
    assert len(prompts[0].messages) == 2  # MT-bench questions have two turns


GOOD = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
BAD_LINES = {  # reason -> the bad line
    "invalid_json": '{"conversations": [',
    "empty_turn": {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
    "unknown_role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "content_not_string": {"messages": [{"role": "user", "content": ["a", "b"]}]},
    "unknown_format": {"prompt_only": "hi"},
    "no_turns": {"conversations": []},
}


def test_bad_records_skipped_and_counted_with_locations(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, *BAD_LINES.values(), GOOD])
    conversations, report = load_conversations([path])
    assert len(conversations) == 2 and report.read == 2 + len(BAD_LINES) and report.kept == 2
    assert dict(report.skipped) == {reason: 1 for reason in BAD_LINES}
    for line_no, reason in enumerate(BAD_LINES, start=2):
        assert report.issues[reason][0].startswith(f"{path}:{line_no}: ")
    summary = report.summary()
    assert summary.startswith(f"records: read {2 + len(BAD_LINES)}, kept 2, skipped {len(BAD_LINES)} (")
    assert all(f"{reason} 1" in summary for reason in BAD_LINES)


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_record_fails_with_location_when_asked(tmp_path: Path, reason: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, BAD_LINES[reason]])
    with pytest.raises(DataError, match=rf"^{path}:2: .*reason {reason}"):
        load_conversations([path], LoadReport(on_error="fail"))


def test_overlong_record_truncated_skipped_or_fatal(tmp_path: Path, stories_tokenizer) -> None:
    long = {"conversations": [{"from": "human", "value": "Tell me a story."},
                              {"from": "gpt", "value": "Once upon a time, there was a dog. " * 40}]}
    path = write_jsonl(tmp_path / "long.jsonl", [GOOD, long])

    conversations, report = load_conversations([path])
    records = ChatFormat(stories_tokenizer, "plain", "<s>", max_length=64).tokenize_all(conversations, report, False)
    assert [len(r) for r in records][1] == 64 and report.truncated == 1 and report.kept == 2

    conversations, report = load_conversations([path])
    fmt = ChatFormat(stories_tokenizer, "plain", "<s>", max_length=64, truncate=False)
    records = fmt.tokenize_all(conversations, report, False)
    assert len(records) == 1 and dict(report.skipped) == {"too_long": 1} and report.kept == 1
    assert report.issues["too_long"][0].startswith(f"{path}:2: ")

    conversations, report = load_conversations([path], LoadReport(on_error="fail"))
    with pytest.raises(DataError, match=rf"^{path}:2: .* > max_length 64"):
        fmt.tokenize_all(conversations, report, False)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_conversations([tmp_path / "missing.jsonl"])
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(DataError, match=r"broken.json:1: not valid JSON"):
        load_conversations([tmp_path / "broken.json"])
    with pytest.raises(DataError, match="on_error must be one of"):
        LoadReport(on_error="ignore")
