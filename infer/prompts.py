"""Prompt sets for generation, benchmarks and validation: JSONL files, and the built-in story openings (8 written for
demos and benchmarks; 64 held-out ones, validation's default).

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

# 64 story openings held out from the pipeline's training data: the first two sentences of stories260K stories
# sampled from BOS at T=1 with seeds 1,000,000 + i (`python -m data_tools.regenerate --from-bos 400 --seed 1000000`;
# the pipeline's stories use seeds 0..2,999), distinct, none of them inside those training stories.
VALIDATION_PROMPTS = [
    "Once upon a time, there was a huge frog. The frog loved to eat crubs that color salt to show to draw.",
    "Once upon a time, there was a dizzy metal dog. One day, a shy girl named Jack and her mom went to the park.",
    "Once upon a time, there was a little puppy who loved to spull. The puppy was very excited and flew around.",
    "Once upon a time, there was a little puppy named Tom. Tom loved to play in the sun.",
    "One day, a a picture of a shark. The piece was very waiting for him to find a rain.",
    "Once upon a time, there was a little boy named Tim. Tim loved to play in the tall house with his mom.",
    "Once upon a time, there was a little girl named Lily. She loved to read her brothers.",
    "Once upon a time, there was a little toy car named Tom. Tom loved to go on time with his friends.",
    "Once upon a time, there was a little girl named Lily. She loved to go on a big road.",
    "Once upon a time, there was a little one. The little bird was very nice.",
    "Once upon a time, there was a little girl named Lily. She loved to play with her toys and eat cookies.",
    "Once upon a time, there was a sweet face. He was very nosy and loved to play with his colors.",
    "Jack was a naughty island. He had liunning he heartb she had a wild ancient batterie.",
    "Once upon a time, there was a little girl named Lily. She had a cool pet pat named Mrs.",
    "Once upon a time there was a big dishwasher. This those discovery had many different trees.",
    "Once upon a time, there was an old man who lived in a big house. He liked to make the man on the ground.",
    "Once upon a time, there was a little goat. He lived in a backyard with his friends.",
    "Once upon a time, there was a big puddle. The sun and the hammers were very pretty, but are the best cat.",
    "One day, a little boy named Tim went to the park with his mom. He saw Lily, Tim.",
    "Once upon a time, there was a boy named Timmy. Timmy loved to play outside and eat again.",
    "One day, a little fish named Bob lived in a small house. He had a big tree.",
    "Once upon a time, there was a dependable girl named Lily. She liked to go on jolly piano around her house.",
    "Once upon a time, there was a big frog named Tim. Tim had a parade on his motor who loved to play.",
    "Once upon a time, there lived a kind bunny named Kack. Kaisy loved to go home to share jackets.",
    "Once upon a time, there was a boy named Timmy. Timmy had a long stone named Jacko.",
    "Once upon a time, there was a little boy named Timmy. He had a calm called Lily.",
    "Once upon a time, there was a little girl named Lily. She had a shiny bird named Bill.",
    "Once upon a time there was a little girl named Lily. One day, Lily saw a moterable advice.",
    "Once upon a time there was a friendly idea. He wondered what happened.",
    "One day, a big fancy reflection. They wanted to show more something spend toy pretty chirps.",
    "Once upon a time, there was a big, small shovel. The shoes were needed help.",
    "Once upon a time, there there was a little boy named Timmy. Timmy loved to draw with his owner.",
    "Once upon a time there was a graceful little rabbit. He loved to sleep in a smooth beach.",
    "They are races. On the radio, there was a monster named Lily.",
    "One day, a cheap bull named Rop wanted to play. He thought for a time, he found a real sun.",
    "One day, a nice boy called a yellow pebble. He had a big bottle of cart shining with his, hungry door.",
    "Once there was a loud movie. It was a small movie.",
    "Once upon a time, there was a little girl named Lily. Lily loved books and she would climb it every day.",
    "Once upon a time, there was always big and angry. She had an elephant named confuse.",
    "One day, a little girl named Lucy went to the park with her mommy. They played with the bathroom on the top.",
    "Once upon a time, there was a boy named Timmy. Timmy loved to play outside in the park.",
    "One day, a little boy named Tim went to the park with his mom. They saw a big tree.",
    "One day, Amy found a big face with locks. It was easy and trees, looking for its mom and dad.",
    "Once upon a time, there was a net on the ground. The grass had many toys and droad high.",
    "On Alicey day, Annie named Anna. She lived in a rind near sheetle.",
    "One day, a little boy named Timmy went to the beach. He had a real toy that he could fly alone.",
    "Aman who was a smart cat. Anna was very kind and wanted to eat too much.",
    "Jenna ate her dolls. She watches how to pet them like she was.",
    "Once upon a time, there was a man named Jill. Jill lived in a big castle with his favorite castle.",
    "Once upon a time, a little ant went to the park. The pearl was very curious.",
    "Once upon a time, there was a boy named Timmy. He had a blue brother arrived at from his frame.",
    "One day, a little girl named Sue found a warm fruit in her garden. She liked to sell it tomato requesty.",
    "Once upon a time, there was a cold stupid dog named Max. Max loved to make everyone in the grass.",
    "Emma a beauty slide to Zidey. She reached one of her parents.",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her friends.",
    "Once upon a time, there was a talking decision. She had a file on the ink.",
    "Once upon a time, there was a little girl named Mia. She loved to jacket covers and rocks outside.",
    "Once upon a time, there was a bird who wanted to see her family. He knew that the new treat was like birds.",
    "Once upon a time, there was a girl named Lily. She loved to play outside and pick delicious trees.",
    "Once upon a time, there was a bear was a giant sink. His sweater was very very happy and slept in her room.",
    "One day, a little boy named Tim found a ladash. He liked to play with pretty things.",
    "Once upon a time, there was a little girl named Lily. She loved to eat.",
    "Once upon upon a time, there was a little girl named Lily. She loved to draw pictures of yellow pictures.",
    "Once upon a time, there was a little bird named Tbel. Tweetie loved to fly around the fields.",
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
