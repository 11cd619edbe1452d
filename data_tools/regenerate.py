"""Self-distillation: answer every user turn again with the target, through the inference runtime.

    python -m data_tools.regenerate --model DIR --input sharegpt.json --output regen.jsonl --temperature 0.7 --seed 0
    python -m data_tools.regenerate --model DIR --input mt_bench_question.jsonl --output mt_bench_regen.jsonl
    python -m data_tools.regenerate --model STORIES --chat-template plain --end-token "<s>" \\
        --prompt "Once upon a time" --prompt "Tom had a red ball." --output openings.jsonl
    python -m data_tools.regenerate --model STORIES --from-bos 1000 --temperature 1 --seed 0 \\
        --stop-token-id 1 --output stories.jsonl

Conversations (ShareGPT, messages, plain text, MT-bench / Spec-Bench "turns") keep their system and user
turns; their assistant turns are replaced by the target's answers. Turn k of every conversation is answered
in one batched round (the answer to turn k is part of the prompt of turn k + 1). A plain-text record counts as
one user turn (an opening for a base model to continue). Output: one {"id", "source", "messages"} record a
line; with --from-bos, {"id", "text"} records of whole stories generated from BOS alone. With --seed, request
i of round k gets its own seed, so the output does not depend on batching.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from data_tools.conversations import Conversation, DataError, LoadReport, load_conversations
from data_tools.shards import atomic_write_bytes
from data_tools.tokenize import PLAIN, ChatFormat
from infer.cli import DTYPES, add_engine_args, engine_kwargs, run_cli
from infer.engine import Engine, Request
from infer.sampling_params import SamplingParams


def user_turns(conversation: Conversation) -> tuple[list[dict], list[str]]:
    """(system messages, user turns) of a record; its assistant turns are dropped."""
    if conversation.kind == "text":
        return [], [conversation.text]
    system = [m for m in conversation.messages if m["role"] == "system"]
    return system, [m["content"] for m in conversation.messages if m["role"] == "user"]


def answer_text(tokenizer, prompt_ids: list[int], output_ids: list[int], stop_ids: frozenset[int]) -> str:
    """The answer as text. Decoded after its prompt and cut off, so that a leading space survives tokenizers
    whose decoder strips the first space of a string (sentencepiece-style: stories260K, Llama 2)."""
    if output_ids and output_ids[-1] in stop_ids:
        output_ids = output_ids[:-1]
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full_text = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    if full_text.startswith(prompt_text):
        return full_text[len(prompt_text):]
    return tokenizer.decode(output_ids, skip_special_tokens=True)


def run_requests(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], desc: str,
                 progress: bool) -> list[Request]:
    """Run token-id prompts to completion, with a bar of generated tokens (tokens/s)."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    bar = tqdm(total=sum(sp.max_new_tokens for sp in params), desc=desc, unit="tok", unit_scale=True,
               disable=not progress, dynamic_ncols=True)
    counted = 0
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
            generated = sum(len(r.output_ids) for r in requests)
            bar.update(generated - counted)
            counted = generated
    bar.total = counted
    bar.close()
    return requests


def sampling(args: argparse.Namespace, stop_ids: frozenset[int], seed_offset: int) -> SamplingParams:
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
        seed=None if args.seed is None else args.seed + seed_offset, stop_token_ids=tuple(sorted(stop_ids)),
    )
    params.validate()
    return params


def regenerate_conversations(engine: Engine, fmt: ChatFormat, conversations: list[Conversation], args,
                             stop_ids: frozenset[int], report: LoadReport, progress: bool) -> list[dict]:
    """Answer turn k of every conversation in round k; returns messages-format records in input order."""
    state = []  # per conversation: (conversation, messages so far, remaining user turns)
    for conversation in conversations:
        system, turns = user_turns(conversation)
        if not turns:
            report.bad_record(conversation.source, "no_user_turn", "has no user turn to answer", policy=False)
            continue
        state.append((conversation, list(system), turns))
    max_turns = max((len(t) for _, _, t in state), default=0)
    alive = [True] * len(state)
    for turn in range(max_turns):
        batch, prompts, params = [], [], []
        for i, (conversation, messages, turns) in enumerate(state):
            if not alive[i] or turn >= len(turns):
                continue
            messages.append({"role": "user", "content": turns[turn]})
            prompt = fmt.prompt_ids(messages)
            if len(prompt) >= engine.max_model_len:
                alive[i] = False
                messages.pop()
                if turn == 0:
                    report.bad_record(conversation.source, "prompt_too_long",
                                      f"prompt of {len(prompt)} tokens leaves no room in the context "
                                      f"({engine.max_model_len})")
                continue
            batch.append(i)
            prompts.append(prompt)
            params.append(sampling(args, stop_ids, seed_offset=i * 1000 + turn))
        requests = run_requests(engine, prompts, params, f"regenerate turn {turn + 1}", progress)
        for i, prompt, request in zip(batch, prompts, requests):
            text = answer_text(fmt.tokenizer, prompt, request.output_ids, stop_ids)
            state[i][1].append({"role": "assistant", "content": text})
    out = []
    for conversation, messages, _ in state:
        if any(m["role"] == "assistant" for m in messages):
            out.append({"id": conversation.id, "source": conversation.source, "messages": messages})
    report.kept = len(out)
    return out


def stories_from_bos(engine: Engine, tokenizer, count: int, args, stop_ids: frozenset[int], progress: bool) -> list[dict]:
    bos = tokenizer.bos_token_id
    if bos is None:
        raise DataError("--from-bos needs a tokenizer with a BOS token")
    params = [sampling(args, stop_ids, seed_offset=i) for i in range(count)]
    requests = run_requests(engine, [[bos]] * count, params, "stories from BOS", progress)
    return [{"id": f"bos-{i}", "text": answer_text(tokenizer, [bos], r.output_ids, stop_ids)}
            for i, r in enumerate(requests)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools.regenerate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="the target: a Hugging Face folder")
    parser.add_argument("--output", required=True, type=Path, help="JSONL file to write (atomically)")
    source = parser.add_argument_group("prompts (one of)")
    source.add_argument("--input", nargs="+", type=Path, default=[], help="conversation or prompt-set files/folders")
    source.add_argument("--prompt", action="append", default=[], help="a user turn (a story opening); repeatable")
    source.add_argument("--from-bos", type=int, default=0, help="generate this many texts from BOS alone")
    parser.add_argument("--chat-template", default=None,
                        help="'plain' for base models (BOS + turns concatenated); default: the tokenizer's")
    parser.add_argument("--end-token", default=None, help="end token of the plain template (stories260K: <s>)")
    parser.add_argument("--stop-token-id", type=int, action="append", default=None,
                        help="stop on this id (repeatable); default: the model's eos ids plus the end token")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="base seed; request i gets its own")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per answer (default 256)")
    parser.add_argument("--batch-size", type=int, default=64, help="most requests decoded together (default 64)")
    parser.add_argument("--on-error", choices=["skip", "fail"], default="skip", help="malformed input records")
    parser.add_argument("--limit", type=int, default=None, help="read at most this many input records")
    parser.add_argument("--no-progress", action="store_true")
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if sum(map(bool, (args.input, args.prompt, args.from_bos))) != 1:
        raise DataError("give exactly one of --input, --prompt or --from-bos")
    if args.from_bos < 0:
        raise DataError(f"--from-bos must be >= 1, got {args.from_bos}")
    progress = not args.no_progress
    engine = Engine.from_pretrained(args.model, dtype=DTYPES[args.dtype], device=args.device,
                                    **engine_kwargs(args, max_num_seqs=args.batch_size))
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise DataError(f"{args.model} has no tokenizer files")
    chat_template = args.chat_template
    if chat_template is None and not tokenizer.chat_template:
        chat_template = PLAIN  # a base model: continue the text
    fmt = ChatFormat(tokenizer, chat_template=chat_template, end_token=args.end_token)
    stop_ids = set(engine.eos_token_ids)
    if args.stop_token_id is not None:
        stop_ids = set(args.stop_token_id)
    elif fmt.end_token:
        end_ids = tokenizer(fmt.end_token, add_special_tokens=False)["input_ids"]
        if len(end_ids) == 1:
            stop_ids.add(end_ids[0])
    stop_ids = frozenset(stop_ids)

    report = LoadReport(on_error=args.on_error)
    if args.from_bos:
        records = stories_from_bos(engine, tokenizer, args.from_bos, args, stop_ids, progress)
    else:
        if args.input:
            conversations, report = load_conversations(args.input, report, limit=args.limit)
        else:
            conversations = [Conversation(f"--prompt[{i}]", "prompts", [{"role": "user", "content": p}])
                             for i, p in enumerate(args.prompt)]
            report.read = report.kept = len(conversations)
        records = regenerate_conversations(engine, fmt, conversations, args, stop_ids, report, progress)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
    print(f"wrote {len(records)} records to {args.output}", file=sys.stderr)
    if not args.from_bos:
        print(report.summary(), file=sys.stderr)
        for line in report.details():
            print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
