"""Benchmark the feature precompute: infer/ on packed batches against transformers on padded batches.

    python -m data_tools.bench_precompute [--limit 200] [--hf-batch-size 16] [--device cpu]

Both sides get the same tokenized records (FastChat's ShareGPT sample through the stories260K plain template:
mixed lengths) in the same order, in the same process, after one warm-up batch each, timed --repeats times alternately (best of each):
  runtime       FeatureExtractor.write_shard, as precompute runs it (longest-first packing under a token
                budget, no padding, hidden states cast to the storage dtype and written into a shard file, here
                an anonymous temporary file);
  transformers  LlamaForCausalLM(..., output_hidden_states=True) on right-padded batches of --hf-batch-size
                records with an attention mask.
Tokens/s counts real tokens only. It also prints bytes per token of a shard as precompute writes it against the
minimum (hidden x dtype bytes + 4 for the id + 1 for the mask).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from data_tools.conversations import LoadReport, load_conversations
from data_tools.precompute import FeatureExtractor
from data_tools.shards import bytes_per_token
from data_tools.tokenize import ChatFormat, TokenizedRecord
from infer.cli import run_cli
from infer.loader import DTYPES, load_config, load_model

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"


def runtime_forward(model_dir: Path, args):
    """The precompute's own path: FeatureExtractor.write_shard over all records (one shard); returns its bytes."""
    model = load_model(model_dir, dtype=torch.float32, device=args.device)
    extractor = FeatureExtractor(model, DTYPES[args.dtype], [], args.max_tokens_per_batch, args.max_records_per_batch)

    def run(records: list[TokenizedRecord]) -> int:
        meta = {"format": "bench", "shard": 0, "fingerprint": "", "sources": [r.source for r in records]}
        with tempfile.TemporaryFile() as f:
            extractor.write_shard(f, records, meta)
            return f.seek(0, 2)

    return run


def transformers_forward(model_dir: Path, args):
    """transformers' forward with output_hidden_states=True on right-padded batches, in record order."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()

    def run_batch(batch: list[TokenizedRecord]) -> None:
        longest = max(len(r) for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, record in enumerate(batch):
            ids[row, : len(record)] = torch.tensor(record.input_ids)
            mask[row, : len(record)] = 1
        out = model(ids.to(args.device), attention_mask=mask.to(args.device), output_hidden_states=True)
        keep = mask.bool().to(args.device)
        for hidden in out.hidden_states:  # what a precompute would keep: real tokens only
            hidden[keep].to(DTYPES[args.dtype]).cpu()

    @torch.inference_mode()
    def run(records: list[TokenizedRecord]) -> None:
        for i in range(0, len(records), args.hf_batch_size):
            run_batch(records[i : i + args.hf_batch_size])

    return run


def timed(fn, records: list[TokenizedRecord], device: str) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    result = fn(records)
    _sync(device)
    return time.perf_counter() - start, result


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools.bench_precompute", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ASSETS / "stories260K" / "hf-reference")
    parser.add_argument("--data", type=Path, default=ASSETS / "eval" / "fastchat_dummy_conversation.json")
    parser.add_argument("--limit", type=int, default=200, help="records to use (default 200)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=16, help="records per padded transformers batch")
    parser.add_argument("--max-tokens-per-batch", type=int, default=8192, help="runtime token budget")
    parser.add_argument("--max-records-per-batch", type=int, default=256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="storage dtype")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per side, interleaved; best is reported")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    conversations, report = load_conversations([args.data], LoadReport(), limit=args.limit)
    template = None if tokenizer.chat_template else "plain"
    fmt = ChatFormat(tokenizer, template, "<s>" if template else None, max_length=args.max_length)
    records = fmt.tokenize_all(conversations, report, progress=False)
    lengths = [len(r) for r in records]
    tokens = sum(lengths)
    padded = sum(max(lengths[i : i + args.hf_batch_size]) * len(lengths[i : i + args.hf_batch_size])
                 for i in range(0, len(lengths), args.hf_batch_size))
    print(f"{len(records)} records, {tokens:,} tokens (lengths {min(lengths)}..{max(lengths)}, mean "
          f"{tokens / len(records):.0f}); padded batches of {args.hf_batch_size} hold {padded:,} positions; "
          f"{torch.get_num_threads()} threads, {args.device}")

    runtime, reference = runtime_forward(args.model, args), transformers_forward(args.model, args)
    runtime(records[: args.hf_batch_size]), reference(records[: args.hf_batch_size])  # warm-up
    runtime_times, reference_times = [], []
    for _ in range(args.repeats):  # interleaved, so that load from other processes hits both sides alike
        seconds, shard_size = timed(runtime, records, args.device)
        runtime_times.append(seconds)
        reference_times.append(timed(reference, records, args.device)[0])
    runtime_s, hf_s = min(runtime_times), min(reference_times)
    print(f"runtime (infer/, packed):          {tokens / runtime_s:9,.0f} tokens/s (best of {args.repeats}: "
          f"{runtime_s:.2f} s; all {', '.join(f'{t:.2f}' for t in runtime_times)})")
    print(f"transformers (padded, all hidden): {tokens / hf_s:9,.0f} tokens/s (best of {args.repeats}: "
          f"{hf_s:.2f} s; all {', '.join(f'{t:.2f}' for t in reference_times)})")
    print(f"speed-up: {hf_s / runtime_s:.2f}x")

    stored = shard_size / tokens
    minimum = bytes_per_token(load_config(args.model).hidden_size, DTYPES[args.dtype], 0)
    print(f"bytes/token on disk: {stored:.1f} (one shard of {len(records)} records, {args.dtype}); "
          f"minimum {minimum} (+{100 * (stored / minimum - 1):.1f}%: record offsets, sources, header)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
