"""Write an untrained head for a target: its last layer, passing h_i through (see init_head_from_target).

    python -m infer.init_head --target DIR --out DIR [--architecture mtp|eagle1|eagle3]

Useful to exercise speculative decoding before a trained head exists; trained heads come from mtp_train.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infer.cli import run_cli
from infer.loader import load_model
from infer.models.mtp_head import init_head_from_target, save_head


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.init_head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, type=Path, help="the target's Hugging Face folder (Llama)")
    parser.add_argument("--out", required=True, type=Path, help="head folder to write")
    parser.add_argument("--architecture", choices=["mtp", "eagle1", "eagle3"], default="mtp",
                        help="mtp: with input and final norms; eagle1: no norms, biased projection; eagle3: three "
                             "target layers fused, the whole vocabulary")
    parser.add_argument("--overwrite", action="store_true", help="replace a head already in --out (nothing else)")
    args = parser.parse_args(argv)
    head = init_head_from_target(load_model(args.target), str(args.target), args.architecture)
    save_head(head, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
