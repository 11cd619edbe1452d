"""What the command-line tools share: engine flags, and turning user mistakes into one-line errors."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from infer.loader import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CliError(ValueError):
    """A mistake in the command line or its input files."""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    group.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and activations")
    group.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    group.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool (default: sized to the batch)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one step; longer prompts are prefilled in chunks (default 2048)")
    group.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], default="auto",
                       help="auto: FlashInfer on CUDA when installed, torch otherwise")


def engine_kwargs(args: argparse.Namespace, max_num_seqs: int) -> dict:
    for flag in ("page_size", "num_pages", "max_num_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if max_num_seqs < 1:
        raise CliError(f"--batch-size must be >= 1, got {max_num_seqs}")
    return dict(page_size=args.page_size, num_pages=args.num_pages, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, backend=args.attention_backend)


def run_cli(main: Callable[[], int]) -> int:
    """Run main; a user's mistake prints one line on stderr and exits 2 (INFER_DEBUG=1 shows the traceback)."""
    try:
        return main()
    except (CliError, ModelLoadError, ValueError, FileNotFoundError) as err:
        if os.environ.get("INFER_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
