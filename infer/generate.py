"""Generate text with the runtime.

    python -m infer.generate --model DIR --prompt "Once upon a time" --max-new-tokens 64
    python -m infer.generate --model DIR --prompt-file prompts.jsonl --temperature 1 --seed 0 --json

    torchrun --nproc_per_node 2 -m infer.generate --tp 2 --model DIR --prompt "Once upon a time"

--prompt-file takes JSONL records with a "prompt", "text" or "turns" field (MT-bench and Spec-Bench
question files work as they are: the first turn is used; see infer.prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from infer.cli import CliError, add_engine_args, add_spec_args, attach_spec, engine_kwargs, run_cli
from infer.engine import Engine
from infer.loader import DTYPES
from infer.parallel import attach_where_it_lives, init_tp, serve_forever, tp_main
from infer.prompts import read_prompt_file
from infer.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for several")
    parser.add_argument("--prompt-file", type=Path, help="JSONL file of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="prompt i samples with seed SEED + i, so a run reproduces exactly")
    parser.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    parser.add_argument("--batch-size", type=int, default=64, help="most requests decoded together (default 64)")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; run under torchrun --nproc_per_node TP")
    add_engine_args(parser)
    add_spec_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = list(args.prompt) + (read_prompt_file(args.prompt_file) if args.prompt_file else [])
    if not prompts:
        raise CliError("give at least one --prompt or a --prompt-file")
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        seed=args.seed, stop=tuple(args.stop),
    )
    tp = init_tp(args.tp, args.device)  # each rank loads its shard of the model (and of an MTP head)
    engine = Engine.from_pretrained(args.model, dtype=DTYPES[args.dtype], device=args.device,
                                    **engine_kwargs(args, max_num_seqs=args.batch_size))
    attach_where_it_lives(args.spec, lambda: attach_spec(engine, args, min(len(prompts), args.batch_size)))
    if tp.rank > 0:  # rank 0 schedules; the others run its steps on their shards
        serve_forever()
        return 0
    params.validate(engine.model.config.vocab_size)
    for i, prompt in enumerate(prompts):
        try:  # prompt i samples with seed S + i: reproducible, yet each prompt draws its own tokens
            seed = None if args.seed is None else args.seed + i
            engine.add_request(prompt, dataclasses.replace(params, seed=seed))
        except ValueError as err:
            raise CliError(f"prompt {i + 1}: {err}") from err
    with torch.inference_mode():
        requests = list(engine.waiting)
        while engine.has_unfinished():
            engine.step()
    for request in requests:
        if args.json:
            record = {
                "prompt": request.prompt, "text": request.text, "token_ids": request.output_ids,
                "num_new_tokens": len(request.output_ids), "finish_reason": request.finish_reason,
                "elapsed_s": round(request.elapsed_s, 4),
            }
            if request.spec_stats is not None:
                record["spec"] = request.spec_stats.to_dict()
            print(json.dumps(record))
        else:
            print(f"{request.prompt}{request.text}\n", file=sys.stdout)
    if engine.spec_stats is not None and not args.json:
        print(f"speculation: {json.dumps(engine.spec_stats.to_dict())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(tp_main(main)))
