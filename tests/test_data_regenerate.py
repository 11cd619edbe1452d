"""Self-distillation through infer/: answers replace the assistant turns; seeded sampling ignores batching."""

from __future__ import annotations

import json
from pathlib import Path

from data_tools import regenerate
from data_tools.conversations import load_conversations
from data_tools.tokenize import ChatFormat
from infer.cli import run_cli


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_story_openings_and_multi_turn_prompts(stories_hf_dir: Path, assets_dir: Path, tmp_path: Path,
                                               stories_tokenizer) -> None:
    questions = tmp_path / "mt.jsonl"
    questions.write_text("".join((assets_dir / "eval" / "mt_bench_question.jsonl").read_text().splitlines(True)[:2]))
    common = ["--model", str(stories_hf_dir), "--end-token", "<s>", "--max-new-tokens", "24", "--no-progress"]

    out = tmp_path / "openings.jsonl"
    assert regenerate.main([*common, "--prompt", "Once upon a time", "--output", str(out)]) == 0
    (record,) = read_jsonl(out)
    assert record["messages"][0] == {"role": "user", "content": "Once upon a time"}
    # Greedy stories260K continues its best-known story; the leading "," (and spaces) survive decoding.
    assert record["messages"][1]["content"].startswith(", there was a little girl named Lily.")

    out = tmp_path / "mt_regen.jsonl"
    assert regenerate.main([*common, "--input", str(questions), "--output", str(out)]) == 0
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["81", "82"]
    for r in records:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
    # The output is a conversation file the rest of the pipeline reads and masks.
    conversations, report = load_conversations([out])
    fmt = ChatFormat(stories_tokenizer, "plain", "<s>", max_length=512)
    assert len(fmt.tokenize_all(conversations, report, progress=False)) == 2


def test_seeded_stories_from_bos_do_not_depend_on_batching(stories_hf_dir: Path, tmp_path: Path) -> None:
    texts = []
    for batch_size in (3, 1):
        out = tmp_path / f"bos{batch_size}.jsonl"
        argv = ["--model", str(stories_hf_dir), "--from-bos", "3", "--temperature", "1", "--seed", "7",
                "--stop-token-id", "1", "--max-new-tokens", "32", "--batch-size", str(batch_size),
                "--output", str(out), "--no-progress"]
        assert regenerate.main(argv) == 0
        texts.append([r["text"] for r in read_jsonl(out)])
    assert texts[0] == texts[1] and len(set(texts[0])) == 3 and all(texts[0])


def test_user_mistakes(stories_hf_dir: Path, tmp_path: Path, capsys) -> None:
    argv = ["--model", str(stories_hf_dir), "--output", str(tmp_path / "x.jsonl")]
    assert run_cli(lambda: regenerate.main(argv)) == 2
    assert capsys.readouterr().err.strip() == "error: give exactly one of --input, --prompt or --from-bos"
    assert run_cli(lambda: regenerate.main([*argv, "--input", str(tmp_path / "none.jsonl")])) == 2
    assert "does not exist" in capsys.readouterr().err
