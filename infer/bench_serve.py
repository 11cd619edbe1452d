"""Load benchmark of infer.serve: Poisson arrivals over a prompt set, plain against speculative at the same rates.

    python -m infer.bench_serve --model DIR --draft HEAD --prompt-file ../shared/assets/eval/mt_bench_question.jsonl \\
        --rates 2,16 --num-requests 64 --max-tokens 64 --json out.json

Each mode's server runs as its own process (`python -m infer.serve`, so the load generator does not share its
interpreter); both get the same prompts and the same arrival times (seeded), the modes taking turns at each rate.
Streamed requests (stream_options.continuous_usage_stats, so every chunk says how many tokens it carries) give:
  ttft  time to first token (from the request's send)
  itl   inter-token latency: each chunk's gap from the previous one, shared among the tokens it brought (a verify
        step's tokens arrive together); itl_chunk: the gaps themselves, as vLLM's bench_serving counts them
  tpot  a request's (latency - ttft) / (tokens - 1)
  tokens/s: output tokens over the span from the first send to the last reply.
--overhead also times batch 1 against `infer.generate`'s engine in this process on the same prompts: per-token
time of sequential non-streamed and streamed requests over the engine's own per-token time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from infer.cli import CliError, parse_floats, run_cli
from infer.engine import Engine
from infer.loader import load_config, load_tokenizer
from infer.prompts import VALIDATION_PROMPTS, read_prompt_file
from infer.sampling_params import SamplingParams
from infer.serve.server import free_port

MODEL = "bench"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infer.bench_serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--draft", type=Path, help="MTP/EAGLE head folder: adds the speculative mode (--spec mtp)")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="fixed K (default: the head's per batch)")
    parser.add_argument("--prompt-file", type=Path, default=None,
                        help="JSONL prompts (MT-bench, Spec-Bench); default: infer.prompts.VALIDATION_PROMPTS, the "
                             "64 held-out story openings the heads are validated on")
    parser.add_argument("--rates", default="2,16", help="arrival rates, requests/s, comma-separated (default 2,16)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per rate and mode (default 64)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request, EOS ignored (default 64)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the servers' batch limit (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="arrivals and prompt order (default 0)")
    parser.add_argument("--overhead", action="store_true", help="also time batch 1 against infer.generate's engine")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    return parser


class ServerProcess:
    """`python -m infer.serve` on a free loopback port, until closed."""

    def __init__(self, args: argparse.Namespace, spec: bool) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "infer.serve", "--model", str(args.model), "--served-model-name", MODEL,
                "--port", str(self.port), "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
                "--max-waiting", str(args.num_requests * 2)]
        if spec:
            argv += ["--spec", "mtp", "--draft", str(args.draft)]
            if args.num_draft_tokens:
                argv += ["--num-draft-tokens", str(args.num_draft_tokens)]
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        self.process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise CliError(f"the server exited: {self.process.stderr.read().strip()[-500:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise CliError("the server did not come up within 120 s")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if len(f.samples) == 1}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def one_request(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, delay: float) -> dict:
    """Wait `delay` s, then stream one completion; its times and token counts."""
    await asyncio.sleep(delay)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    sent = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (time, tokens so far) per chunk that brought tokens
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            tokens = chunk["usage"]["completion_tokens"]
            if tokens > (arrivals[-1][1] if arrivals else 0):
                arrivals.append((time.perf_counter(), tokens))
    if not arrivals:
        return {"error": "no tokens"}
    return {"sent": sent, "ttft": arrivals[0][0] - sent, "end": arrivals[-1][0], "tokens": arrivals[-1][1],
            "arrivals": [(t - sent, n) for t, n in arrivals]}


async def run_load(url: str, prompts: list[str], delays: list[float], max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        return await asyncio.gather(*(one_request(http, url, p, max_tokens, d) for p, d in zip(prompts, delays)))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(records: list[dict]) -> dict:
    """TTFT, ITL (per token and per chunk) and TPOT medians and p99 in ms, and tokens/s, of one load run."""
    done = [r for r in records if "error" not in r]
    itl, itl_chunk, tpot = [], [], []
    for r in done:
        for (t0, n0), (t1, n1) in zip(r["arrivals"], r["arrivals"][1:]):
            itl += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
            itl_chunk.append(t1 - t0)
        if r["tokens"] > 1:
            tpot.append((r["arrivals"][-1][0] - r["ttft"]) / (r["tokens"] - 1))
    span = max(r["end"] for r in done) - min(r["sent"] for r in done) if done else float("nan")

    def ms(values: list[float]) -> dict:
        return {"median": round(1e3 * statistics.median(values), 3) if values else None,
                "p99": round(1e3 * percentile(values, 99), 3) if values else None}

    return {"completed": len(done), "errors": [r["error"] for r in records if "error" in r][:5],
            "ttft_ms": ms([r["ttft"] for r in done]), "itl_ms": ms(itl), "itl_chunk_ms": ms(itl_chunk),
            "tpot_ms": ms(tpot), "output_tokens": sum(r["tokens"] for r in done),
            "tokens_per_s": round(sum(r["tokens"] for r in done) / span, 2) if done else None,
            "duration_s": round(span, 3)}


def batch1_overhead(args: argparse.Namespace, servers: dict[str, ServerProcess], prompts: list[str]) -> dict:
    """Per-token ms at batch 1 (prefill included): the engine as infer.generate drives it (this process) against the
    plain server, non-streamed and streamed, on the same prompts, alternating request by request; the overheads are
    medians of the per-request ratios (a spell of load on this shared machine meets one request of each kind)."""
    engine = Engine.from_pretrained(args.model, device=args.device)
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    engine.generate(prompts[:2], params)  # warm-up
    url = servers["plain"].url
    body = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    per_token: dict[str, list[float]] = {"generate": [], "server": [], "server_stream": []}
    with httpx.Client(timeout=120) as http:
        http.post(f"{url}/v1/completions", json={**body, "prompt": prompts[0]})  # warm-up
        for prompt in prompts:
            start = time.perf_counter()
            (request,) = engine.generate([prompt], params)
            per_token["generate"].append((time.perf_counter() - start) / len(request.output_ids))
            start = time.perf_counter()
            reply = http.post(f"{url}/v1/completions", json={**body, "prompt": prompt}).json()
            per_token["server"].append((time.perf_counter() - start) / reply["usage"]["completion_tokens"])
            (record,) = asyncio.run(run_load(url, [prompt], [0.0], args.max_tokens))
            per_token["server_stream"].append((record["end"] - record["sent"]) / record["tokens"])
    ratios = {k: statistics.median(a / g for a, g in zip(v, per_token["generate"])) - 1
              for k, v in per_token.items() if k != "generate"}
    return {"per_token_ms_median": {k: round(1e3 * statistics.median(v), 4) for k, v in per_token.items()},
            "overhead": round(ratios["server"], 4), "overhead_stream": round(ratios["server_stream"], 4),
            "requests": len(prompts), "max_tokens": args.max_tokens}


def fitting_prompts(prompts: list[str], args: argparse.Namespace) -> list[str]:
    """The prompts with room for --max-tokens in the model's context (a small model's context drops long ones)."""
    tokenizer, context = load_tokenizer(args.model), load_config(args.model).max_position_embeddings
    if tokenizer is None:
        raise CliError(f"{args.model} has no tokenizer")
    fitting = [p for p in prompts if len(tokenizer.encode(p, verbose=False)) + args.max_tokens <= context]
    if not fitting:
        source = args.prompt_file or "VALIDATION_PROMPTS"
        raise CliError(f"no prompt of {source} leaves room for {args.max_tokens} tokens in the model's "
                       f"context of {context}")
    if len(fitting) < len(prompts):
        print(f"note: {len(prompts) - len(fitting)} of {len(prompts)} prompts leave no room for --max-tokens "
              f"{args.max_tokens} in the context of {context}: left out", file=sys.stderr)
    return fitting


def table(results: dict) -> str:
    lines = [f"{'rate':>6} {'mode':>6} {'done':>5} {'ttft_med':>9} {'ttft_p99':>9} {'itl_med':>8} {'itl_p99':>8} "
             f"{'tpot_med':>9} {'tok/s':>8} {'tau':>5}"]
    for run in results["runs"]:
        s = run["summary"]
        lines.append(f"{run['rate']:>6g} {run['mode']:>6} {s['completed']:>5} {s['ttft_ms']['median']:>9} "
                     f"{s['ttft_ms']['p99']:>9} {s['itl_ms']['median']:>8} {s['itl_ms']['p99']:>8} "
                     f"{s['tpot_ms']['median']:>9} {s['tokens_per_s']:>8} {run.get('tau', ''):>5}")
    if "batch1" in results:
        b = results["batch1"]
        lines.append(f"batch 1 per-token ms: {b['per_token_ms_median']} overhead {100 * b['overhead']:.1f}% "
                     f"(streamed {100 * b['overhead_stream']:.1f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rates = parse_floats(args.rates, "--rates")
    if not rates or min(rates) <= 0:
        raise CliError(f"--rates must be positive numbers, got {args.rates!r}")
    if args.num_requests < 1 or args.max_tokens < 1:
        raise CliError("--num-requests and --max-tokens must be >= 1")
    prompts = list(VALIDATION_PROMPTS) if args.prompt_file is None else read_prompt_file(args.prompt_file)
    pool = fitting_prompts(prompts, args)
    rng = random.Random(args.seed)
    modes = ["plain"] + (["spec"] if args.draft else [])
    servers = {}
    try:
        for mode in modes:
            servers[mode] = ServerProcess(args, spec=mode == "spec")
        results = {"model": str(args.model), "draft": str(args.draft) if args.draft else None,
                   "prompt_file": str(args.prompt_file), "max_tokens": args.max_tokens,
                   "num_requests": args.num_requests, "runs": []}
        for rate in rates:
            prompts = [rng.choice(pool) for _ in range(args.num_requests)]
            gaps = [rng.expovariate(rate) for _ in prompts]
            delays = [sum(gaps[:i]) for i in range(len(gaps))]
            for mode in modes:
                before = servers[mode].metrics()
                records = asyncio.run(run_load(servers[mode].url, prompts, delays, args.max_tokens))
                run = {"rate": rate, "mode": mode, "summary": summarize(records)}
                if mode == "spec":
                    after = servers[mode].metrics()
                    verify = [m.get("infer_spec_verify_steps", 0.0) for m in (before, after)]
                    emitted = [m.get("infer_spec_tau", 0.0) * v for m, v in zip((before, after), verify)]
                    run["verify_steps"] = verify[1] - verify[0]
                    run["tau"] = (round((emitted[1] - emitted[0]) / run["verify_steps"], 4)
                                  if run["verify_steps"] else None)
                    run["speculated_share_cumulative"] = after.get("infer_spec_speculated_share")
                results["runs"].append(run)
                print(table({"runs": [run]}).splitlines()[1], file=sys.stderr, flush=True)
        if args.overhead:
            results["batch1"] = batch1_overhead(args, servers, pool[:16])
    finally:
        for server in servers.values():
            server.close()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
