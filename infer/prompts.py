"""Prompt sets for generation, benchmarks and validation: JSONL files, and the built-in story openings.

A JSONL record is a string, or an object with a string "prompt" or "text" field, or a "turns" list (MT-bench and
Spec-Bench question files work as they are: the first turn is used).
"""

from __future__ import annotations

import json
from pathlib import Path

# Story openings for TinyStories-like targets (stories260K): MT-bench questions mean nothing to such a model.
DEFAULT_PROMPTS = [
    "Once upon a time, there was a little dog named Max.",
    "Lily and her mom went to the beach on a sunny day.",
    "One day, Tim found a shiny red ball in the garden.",
    "The little bird wanted to fly high in the sky.",
    "Sara had a big box of crayons and a new book.",
    "There was a small boat on the lake near the woods.",
    "Ben liked to help his dad in the kitchen.",
    "Anna saw a cat sitting on the fence.",
]


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and line."""


def read_prompt_file(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist")
    prompts = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{path}:{line_no}: not valid JSON ({err.msg})") from err
        text = record if isinstance(record, str) else prompt_of(record)
        if not isinstance(text, str):
            raise PromptFileError(f"{path}:{line_no}: expected a string field 'prompt', 'text' or 'turns'")
        prompts.append(text)
    if not prompts:
        raise PromptFileError(f"prompt file {path} holds no prompts")
    return prompts


def prompt_of(record: object) -> str | None:
    if not isinstance(record, dict):
        return None
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("turns")
    return turns[0] if isinstance(turns, list) and turns else None
