"""Serve a model over the OpenAI API.

    python -m infer.serve --model DIR [--spec mtp --draft HEAD] [--host 127.0.0.1 --port 8000]
    torchrun --nproc_per_node 2 -m infer.serve --tp 2 --model DIR          (rank 0 serves, the others follow)

Routes: POST /v1/completions and /v1/chat/completions (streaming with "stream": true), GET /v1/models, /health and
/metrics (Prometheus). With a head, each step speculates with the head's recommended K for its batch size (from
its export's recommended_k; 0 decodes that batch plainly) unless --num-draft-tokens fixes K.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from infer.cli import (
    DEFAULT_NUM_DRAFT_TOKENS, CliError, add_engine_args, add_spec_args, attach_spec, engine_kwargs, run_cli,
)
from infer.engine import Engine
from infer.loader import DTYPES
from infer.models.mtp_head import read_head_config
from infer.parallel import attach_where_it_lives, init_tp, serve_forever, tp_main
from infer.serve.app import build_app
from infer.serve.completions import Served
from infer.serve.engine_loop import EngineLoop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path,
                        help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: the "
                                                                  "folder's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most requests decoded together (default 64)")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests queued beyond the running batch; more get 429 with Retry-After (default 256)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks; run under torchrun --nproc_per_node TP")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_engine_args(parser)
    add_spec_args(parser)
    return parser


def attach_serving_spec(engine: Engine, args: argparse.Namespace) -> None:
    """The drafter the flags ask for, speculating per step with the head's recommended K for the step's batch size
    (`MTPHeadConfig.num_draft_tokens_for`), or --num-draft-tokens at every size."""
    if args.spec == "none" or args.num_draft_tokens is not None or args.spec != "mtp" or args.draft is None:
        attach_spec(engine, args, args.max_num_seqs)
        return
    config = read_head_config(args.draft)
    table = {int(b): int(k) for b, k in config.recommended_k.items()}
    if table and max(table.values()) == 0:
        attach_spec(engine, args, args.max_num_seqs)  # prints why it attaches nothing
        return
    largest = max(table.values()) if table else DEFAULT_NUM_DRAFT_TOKENS
    attach_spec(engine, argparse.Namespace(**{**vars(args), "num_draft_tokens": largest}), args.max_num_seqs)
    if table:
        engine.draft_k_for_batch = config.num_draft_tokens_for


def build_served(args: argparse.Namespace) -> Served:
    """Load the engine and its drafter (every rank); on rank 0, the loop thread and what the handlers share."""
    engine = Engine.from_pretrained(args.model, dtype=DTYPES[args.dtype], device=args.device,
                                    **engine_kwargs(args, max_num_seqs=args.max_num_seqs))
    if engine.tokenizer is None:
        raise CliError(f"{args.model} has no tokenizer (tokenizer.json or tokenizer.model): the server takes text")
    attach_where_it_lives(args.spec, lambda: attach_serving_spec(engine, args))
    name = args.served_model_name or args.model.resolve().name
    return Served(engine, EngineLoop(engine, args.max_waiting), name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    if args.max_waiting < 1:
        raise CliError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    tp = init_tp(args.tp, args.device)
    served = build_served(args)
    if tp.rank > 0:  # rank 0 schedules and serves; the others run its steps on their shards
        serve_forever()
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    served.loop.start()
    try:
        uvicorn.run(build_app(served), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        served.loop.stop()
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(served: Served, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Serve in this process (the loop thread and uvicorn's, for tests and the load benchmark); yields the base URL
    and stops both on exit."""
    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(build_app(served), host=host, port=port, log_level="warning"))
    served.loop.start()
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            served.loop.stop()
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        served.loop.stop()


if __name__ == "__main__":
    sys.exit(run_cli(tp_main(main)))
