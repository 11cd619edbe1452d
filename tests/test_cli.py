"""`python -m infer.generate`: JSON output, prompt files, and one-line errors (exit 2, no traceback) for bad input.

Runs main in-process through run_cli (as the module entry point does) and captures at the file-descriptor level, so
stray prints, progress bars and library warnings count too; one test runs the real module in a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import GPT2Config

from infer.cli import run_cli
from infer.generate import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROJECT_ROOT = Path(__file__).resolve().parents[1]
JSON_KEYS = {"prompt", "text", "token_ids", "num_new_tokens", "finish_reason", "elapsed_s"}
# What greedy decoding from BOS begins with (shared/assets/README.md).
REFERENCE_STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)


def cli(argv: list[str], capfd) -> tuple[int, str, str]:
    capfd.readouterr()  # drop anything earlier tests left
    code = run_cli(lambda: main([str(a) for a in argv]))
    out, err = capfd.readouterr()
    return code, out, err


def json_lines(out: str) -> list[dict]:
    lines = [line for line in out.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every stdout line must be a JSON object


def assert_one_line_error(code: int, err: str, *culprits: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    for culprit in culprits:
        assert culprit in lines[0], lines[0]


def test_json_prints_one_object_per_prompt(stories_hf_dir, stories_tokenizer, capfd):
    prompts = ["Once upon a time", "Tom"]
    code, out, err = cli(
        ["--model", stories_hf_dir, "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", 12, "--json"],
        capfd,
    )
    assert code == 0, err
    records = json_lines(out)
    assert len(records) == 2
    for prompt, record in zip(prompts, records):
        assert set(record) == JSON_KEYS
        assert record["prompt"] == prompt
        assert record["num_new_tokens"] == len(record["token_ids"]) == 12
        assert record["finish_reason"] == "length"
        # text is the continuation as it reads after the prompt (a leading space survives)
        full = stories_tokenizer.decode(stories_tokenizer.encode(prompt) + record["token_ids"], skip_special_tokens=True)
        assert prompt + record["text"] == full
        assert isinstance(record["elapsed_s"], float) and record["elapsed_s"] >= 0
    assert REFERENCE_STORY.startswith(prompts[0] + records[0]["text"])


def test_plain_output_prints_prompt_and_continuation(stories_hf_dir, capfd):
    code, out, err = cli(["--model", stories_hf_dir, "--prompt", "Once upon a time", "--max-new-tokens", 12], capfd)
    assert code == 0, err
    assert out.startswith("Once upon a time, there was a little girl")


def test_stop_string_flag(stories_hf_dir, capfd):
    code, out, err = cli(
        ["--model", stories_hf_dir, "--prompt", "Once upon a time", "--max-new-tokens", 40, "--stop", "Lily", "--json"],
        capfd,
    )
    assert code == 0, err
    (record,) = json_lines(out)
    assert record["text"] == ", there was a little girl named " and record["finish_reason"] == "stop"


def test_mt_bench_prompt_file(stories_hf_dir, assets_dir, tmp_path, capfd):
    lines = (assets_dir / "eval" / "mt_bench_question.jsonl").read_text().splitlines()[:3]
    prompt_file = tmp_path / "mt_bench_3.jsonl"
    prompt_file.write_text("\n".join(lines) + "\n")
    code, out, err = cli(
        ["--model", stories_hf_dir, "--prompt-file", prompt_file, "--max-new-tokens", 4, "--json",
         "--temperature", 1, "--seed", 0],
        capfd,
    )
    assert code == 0, err
    records = json_lines(out)
    assert [r["prompt"] for r in records] == [json.loads(line)["turns"][0] for line in lines]  # the first turn
    assert all(r["num_new_tokens"] == 4 and set(r) == JSON_KEYS for r in records)


def test_missing_model_folder(tmp_path, capfd):
    code, _, err = cli(["--model", tmp_path / "no_such_model", "--prompt", "hi"], capfd)
    assert_one_line_error(code, err, "no_such_model")


def test_unsupported_architecture(tmp_path, capfd):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    code, _, err = cli(["--model", tmp_path, "--prompt", "hi"], capfd)
    assert_one_line_error(code, err, "gpt2")


def test_architecture_unknown_to_transformers(tmp_path, capfd):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_new_arch", "hidden_size": 8}))
    code, _, err = cli(["--model", tmp_path, "--prompt", "hi"], capfd)
    assert_one_line_error(code, err, "my_new_arch")


@pytest.mark.parametrize(
    "flag, value, culprit",
    [
        ("--temperature", "-1", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-k", "-5", "top_k"),
        ("--max-new-tokens", "0", "max_new_tokens"),
        ("--page-size", "0", "--page-size"),
        ("--batch-size", "0", "--batch-size"),
    ],
)
def test_bad_sampling_and_engine_flags(stories_hf_dir, capfd, flag, value, culprit):
    code, _, err = cli(["--model", stories_hf_dir, "--prompt", "hi", flag, value], capfd)
    assert_one_line_error(code, err, culprit, value)


class RecordList(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_prompt_longer_than_the_context(stories_hf_dir, capfd):
    """Only our line: transformers' own "Token indices sequence length is longer than ..." warning would be a second
    stderr line (its handler writes to the stream it saw at import, which capfd cannot see, hence the handler)."""
    warnings = RecordList()
    logger = logging.getLogger("transformers")
    logger.addHandler(warnings)
    try:
        code, _, err = cli(["--model", stories_hf_dir, "--prompt", "Tom", "--prompt", "hello world " * 300], capfd)
    finally:
        logger.removeHandler(warnings)
    assert_one_line_error(code, err, "prompt 2", "512")
    assert [r.getMessage() for r in warnings.records] == []


def test_prompt_file_that_is_not_json(stories_hf_dir, tmp_path, capfd):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text('{"prompt": "Tom"}\nOnce upon a time\n')
    code, _, err = cli(["--model", stories_hf_dir, "--prompt-file", prompt_file], capfd)
    assert_one_line_error(code, err, "prompts.jsonl:2")


@pytest.mark.parametrize("content, culprit", [(None, "does not exist"), ('{"id": 3}\n', ":1"), ("\n\n", "no prompts")])
def test_prompt_file_without_prompts(stories_hf_dir, tmp_path, capfd, content, culprit):
    prompt_file = tmp_path / "prompts.jsonl"
    if content is not None:
        prompt_file.write_text(content)
    code, _, err = cli(["--model", stories_hf_dir, "--prompt-file", prompt_file], capfd)
    assert_one_line_error(code, err, "prompts.jsonl", culprit)


def test_kv_cache_too_small_for_the_request(stories_hf_dir, capfd):
    """4 pages of 4 tokens cannot hold a 5-token prompt plus 40 new tokens: refuse with one line (exit 2), or run
    to the end; never a traceback from deep inside the engine."""
    code, out, err = cli(
        ["--model", stories_hf_dir, "--prompt", "Once upon a time", "--max-new-tokens", 40, "--page-size", 4,
         "--num-pages", 4, "--json"],
        capfd,
    )
    if code == 2:
        assert_one_line_error(code, err)
        assert "KV cache" in err or "pages" in err
    else:
        assert code == 0, err
        (record,) = json_lines(out)
        assert record["finish_reason"] in ("length", "stop")


def test_no_prompt_at_all(stories_hf_dir, capfd):
    code, _, err = cli(["--model", stories_hf_dir], capfd)
    assert_one_line_error(code, err, "--prompt")


def test_module_entry_point_in_a_subprocess(stories_hf_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(PROJECT_ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "infer.generate", "--model", str(stories_hf_dir), "--prompt", "Once upon a time",
         "--max-new-tokens", "8", "--json"],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (record,) = json_lines(result.stdout)
    assert set(record) == JSON_KEYS and record["num_new_tokens"] == 8
    assert REFERENCE_STORY.startswith("Once upon a time" + record["text"])


def test_cuda_graphs_need_a_cuda_device(stories_hf_dir, capfd):
    code, _, err = cli(["--model", stories_hf_dir, "--prompt", "hi", "--device", "cpu", "--cuda-graphs"], capfd)
    assert_one_line_error(code, err, "--cuda-graphs", "cpu")
    code, out, _ = cli(["--model", stories_hf_dir, "--prompt", "hi", "--max-new-tokens", "2", "--no-cuda-graphs"],
                       capfd)
    assert code == 0 and out  # the control: off runs



def test_overlap_flag_reaches_the_engine_and_gives_the_same_story(stories_hf_dir, capfd, monkeypatch):
    """--overlap launches steps from the device's tokens (`follow_on` is called; never with --no-overlap, the
    control) and prints the same story."""
    import infer.engine.loop as loop_module  # noqa: PLC0415
    from infer.engine.overlap import follow_on  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(loop_module, "follow_on", lambda *args: calls.append(1) or follow_on(*args))
    outputs, counts = {}, {}
    for flag in ("--overlap", "--no-overlap"):
        code, out, err = cli(["--model", stories_hf_dir, "--prompt", "Once upon a time", "--max-new-tokens", 12,
                              flag], capfd)
        assert code == 0, err
        outputs[flag], counts[flag] = out, len(calls)
    assert outputs["--overlap"] == outputs["--no-overlap"]
    assert outputs["--overlap"].startswith("Once upon a time, there was a little girl")
    assert counts == {"--overlap": 12, "--no-overlap": 12}  # one a step with it, none more without


def test_overlap_with_a_drafter_says_it_overlaps_nothing(stories_hf_dir, capfd):
    """A drafter turns overlap off (`infer.engine.overlap`): --overlap with --spec says so, once; without it, nothing."""
    spec = ["--model", stories_hf_dir, "--prompt", "Once upon a time", "--max-new-tokens", 4, "--spec", "draft",
            "--draft", stories_hf_dir, "--num-draft-tokens", 2]
    code, out, err = cli([*spec, "--overlap"], capfd)
    assert code == 0 and out.startswith("Once upon a time, there was")
    assert err.count("--overlap overlaps plain decoding only") == 1
    code, _, err = cli(spec, capfd)
    assert code == 0 and "--overlap" not in err
