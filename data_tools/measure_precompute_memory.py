"""Peak memory of precomputing one feature shard, against the shard's bytes, on a randomly initialised Llama.

    python -m data_tools.measure_precompute_memory     # Llama-3.2-1B shapes (hidden 2048, vocab 128256), 2 layers
    python -m data_tools.measure_precompute_memory --records 48 --aux-layers      # a 3x larger shard, no aux layer

The shard goes through precompute's own path (FeatureExtractor.write_shard into an atomic_file in a temporary
folder). Peak RSS is this process's VmHWM from /proc/self/status after resetting it through /proc/self/clear_refs,
minus VmRSS at the reset: the model, Python and torch are in the baseline, the step's own high-water mark is
what is reported. Two steps are measured:
  batch  one packed forward of a full batch, cast to the storage dtype: the transient any shard pays on top of
         the model, set by the token budget (precompute.max_tokens_per_batch), not by the shard;
  shard  the whole shard computed and written.
The shard's own share, what grows with its size, is (shard - batch): precompute's bound is shard <= 1.3 x the
shard's bytes once shards are large against a batch (tests/test_feature_integrity.py checks it on a small model).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig

from data_tools.precompute import FeatureExtractor
from data_tools.shards import atomic_file, shard_name
from data_tools.tokenize import TokenizedRecord
from infer.cli import run_cli
from infer.loader import DTYPES
from infer.models.llama import LlamaForCausalLM


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


def peak_bytes(step) -> int:
    """Bytes the process's resident set grew to at most during step(), over its size when step() started."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    start = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - start) * 1024


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_tools.measure_precompute_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-3.2-1B has 16; default 2)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--aux-layers", type=int, nargs="*", default=[0], help="aux layers stored (default 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="storage dtype")
    parser.add_argument("--records", type=int, default=16, help="records in the shard")
    parser.add_argument("--record-tokens", type=int, default=512, help="tokens per record")
    parser.add_argument("--max-tokens-per-batch", type=int, default=1024)
    parser.add_argument("--json", action="store_true", help="one JSON line instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.record_tokens, 128),
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    extractor = FeatureExtractor(model, DTYPES[args.dtype], args.aux_layers, args.max_tokens_per_batch,
                                 args.records)
    records = [TokenizedRecord(f"random[{i}]", torch.randint(3, args.vocab, (args.record_tokens,)).tolist(),
                               [1] * args.record_tokens) for i in range(args.records)]
    meta = {"format": "measure", "shard": 0, "fingerprint": "", "sources": [r.source for r in records]}
    first_batch = [records[i].input_ids for i in extractor.batches([len(r) for r in records])[0]]

    def one_batch() -> None:
        states, aux = extractor.forward(first_batch)
        [t.to(DTYPES[args.dtype]).cpu() for t in (states, *aux.values())]

    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / shard_name(0, 1)

        def one_shard() -> None:
            with atomic_file(path) as f:
                extractor.write_shard(f, records, meta)

        one_batch()  # warm-up: thread pools, allocator
        batch = peak_bytes(one_batch)
        shard = peak_bytes(one_shard)
        stored = path.stat().st_size
    figures = {"shard_bytes": stored, "tokens": args.records * args.record_tokens,
               "peak_batch_bytes": batch, "peak_shard_bytes": shard, "ratio": shard / stored,
               "shard_share_ratio": (shard - batch) / stored}
    if args.json:
        print(json.dumps(figures))
        return 0
    mb = 1e6
    print(f"model: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}; "
          f"shard: {args.records} records x {args.record_tokens} tokens, {args.dtype}, aux layers {args.aux_layers}, "
          f"batches of {args.max_tokens_per_batch} tokens")
    print(f"shard bytes on disk:        {stored / mb:9.1f} MB")
    print(f"peak RSS increase, 1 batch: {batch / mb:9.1f} MB (forward + cast of one full batch)")
    print(f"peak RSS increase, shard:   {shard / mb:9.1f} MB = {figures['ratio']:.2f} x shard bytes "
          f"(the shard's own share, minus one batch: {figures['shard_share_ratio']:.2f} x)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
