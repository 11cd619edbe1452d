"""What the command-line tools share: engine flags, and turning user mistakes into one-line errors."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from infer import parallel
from infer.atomic_io import OutputExistsError
from infer.block_drafter import BLOCK_PROPOSALS
from infer.engine import EngineConfig
from infer.loader import DTYPES, ModelLoadError
from infer.models.mtp_head import HeadLoadError, read_head_config


class CliError(ValueError):
    """A mistake in the command line or its input files."""


def parse_ints(text: str, flag: str) -> list[int]:
    """A flag's comma-separated integers, each at least 1 (batch sizes, draft counts)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise CliError(f"{flag} takes comma-separated integers, got {text!r}") from err
    if not values or min(values) < 1:
        raise CliError(f"{flag} values must be >= 1, got {text!r}")
    return values


def parse_floats(text: str, flag: str) -> list[float]:
    """A flag's comma-separated numbers (temperatures)."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise CliError(f"{flag} takes comma-separated numbers, got {text!r}") from err


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
    group.add_argument("--decode-run-steps", type=int, default=EngineConfig.decode_run_steps,
                       help="plain decode steps of an unchanged batch whose page metadata and attention plan are "
                            f"built at once (1: every step alone; default {EngineConfig.decode_run_steps})")
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                       help="replay decode, verify and a head's forwards from CUDA graphs captured per padded batch "
                            "size (CUDA only; default off until the GPU check has passed on a device)")
    group.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=EngineConfig.overlap,
                       help="without speculation, launch each decode step from the device's sampled tokens before the "
                            "host reads the previous step's (the same tokens; a request that stops computes one extra "
                            "row, discarded); default off until the GPU check has timed it")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--spec", choices=["none", "draft", "mtp", "block"], default="none",
                       help="draft: a smaller LM folder proposes; mtp: a head folder proposes (MTP, EAGLE-1, EAGLE-3 "
                            "or block, from its config); block: a block head, K drafts from one forward (default "
                            "none)")
    group.add_argument("--draft", type=Path, help="the draft LM folder (--spec draft) or head folder (--spec mtp)")
    group.add_argument("--num-draft-tokens", type=int, default=None,
                       help="K, tokens proposed per step (default: the head's recommended K for the batch, else 4; "
                            "a recommended 0, plain decoding predicted faster, does not speculate)")
    add_block_proposals_arg(group)


def add_block_proposals_arg(group: argparse._ActionsContainer) -> None:
    group.add_argument("--block-proposals", choices=list(BLOCK_PROPOSALS), default=EngineConfig.block_proposals,
                       help="a block head's drafts at T > 0: argmax (verified with a one-hot q) or sample (each "
                            f"drawn from its own row's distribution); default {EngineConfig.block_proposals}")


DEFAULT_NUM_DRAFT_TOKENS = 4


def attach_spec(engine, args: argparse.Namespace, batch_size: int) -> None:
    """Attach the drafter the flags ask for; flag mistakes become one-line errors. Without --num-draft-tokens, an
    MTP head's recommended K for `batch_size` (written by `mtp_train.export --report`) is used, else 4; a
    recommended 0 (plain decoding predicted faster) attaches nothing, with a note."""
    if args.spec == "none":
        return
    if args.draft is None:
        raise CliError(f"--spec {args.spec} needs --draft DIR")
    k = args.num_draft_tokens
    if k is None:
        recommended = read_head_config(args.draft).num_draft_tokens_for(batch_size) if args.spec != "draft" else None
        if recommended == 0:
            if parallel.current().rank == 0:
                print(f"note: {args.draft}'s validation predicts that no K beats plain decoding at batch {batch_size} "
                      "(its recommended_k): decoding without speculation; --num-draft-tokens K speculates anyway",
                      file=sys.stderr)
            return
        k = recommended or DEFAULT_NUM_DRAFT_TOKENS
    if not 1 <= k <= 16:
        raise CliError(f"--num-draft-tokens must be in 1..16, got {k}")
    engine.num_draft_tokens = k
    engine.load_drafter(args.spec, args.draft)
    if args.overlap and parallel.current().rank == 0:
        print("note: --overlap overlaps plain decoding only; with a drafter attached no step is overlapped",
              file=sys.stderr)


def engine_kwargs(args: argparse.Namespace, max_num_seqs: int) -> dict:
    for flag in ("page_size", "num_pages", "max_num_batched_tokens", "decode_run_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if max_num_seqs < 1:
        raise CliError(f"--batch-size must be >= 1, got {max_num_seqs}")
    # --block-proposals comes with the spec flags; a CLI without them (data_tools.regenerate) attaches no drafter
    proposals = getattr(args, "block_proposals", EngineConfig.block_proposals)
    return dict(page_size=args.page_size, num_pages=args.num_pages, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, backend=args.attention_backend,
                decode_run_steps=args.decode_run_steps, cuda_graphs="on" if args.cuda_graphs else "off",
                overlap=args.overlap, block_proposals=proposals)


def run_cli(main: Callable[[], int]) -> int:
    """Run main; a user's mistake prints one line on stderr and exits 2 (INFER_DEBUG=1 shows the traceback)."""
    try:
        return main()
    except (CliError, ModelLoadError, HeadLoadError, OutputExistsError, ValueError, FileNotFoundError) as err:
        if os.environ.get("INFER_DEBUG"):
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)  # one line, whatever the message
        return 2
