"""Decode speed of the runtime against transformers, and of speculative decoding against plain decoding.

    python -m infer.bench --model DIR --batch-sizes 1,8,32 --max-new-tokens 128
    python -m infer.bench --model DIR --spec mtp --draft HEAD_DIR --num-draft-tokens 1,2,3,4 --temperatures 0,1
    torchrun --nproc_per_node 2 -m infer.bench --tp 2 --model DIR --spec mtp --draft HEAD_DIR

Every figure is measured in the same run as its baseline (these machines are shared and noisy) and
reported as a ratio, the runs compared interleaved step by step so that a spell of load meets both. Without
--spec: tokens/s of this runtime and of transformers' `generate` on the same prompts (greedy, fixed output length),
the runtime's steps taken between generate's (`run_alongside_transformers`); the ratio is the median over the
repeats and ratio_range its spread. With --spec: tokens/s with and without speculation, the speedup,
tau (tokens per target step), and the ideal speedup predicted from the measured acceptance and the
measured cost of a draft forward and a verify forward, timed in turns as a step runs them (`infer.bench.speedup`), so
that achieved / ideal is the share of the ideal the runtime's machinery keeps; *_alone prices each model's
forwards timed back to back instead (each model alone in the caches: a bound no speculative step meets). The
forwards are timed after each repeat's pair of runs; speedup, ideal and their ratio are medians over the repeats
(each repeat against its own costs), tokens/s the fastest runs'.
On a CPU a row also splits a step of the fastest runs into its model forwards and the host work around them
(plain_host_ms, spec_forward_ms, spec_host_ms, per step): the host work is all the ideal leaves out, and
spec_forward_ms against t_catch_up + (K-1) * t_draft + t_verify (a head; a draft LM's K * t_draft) is what the
forwards lose inside a step (the verify's keys pad to the batch's longest). A head's step opens with its catch-up over
the K+1 verified rows, whose output is the first draft: the ideal prices that forward at its own cost (t_catch_up).
A batch's requests accept differently, so a batch ends in steps of a shrinking batch that the ideal (every step a
full batch at the mean tau) does not price: spec_steps against steps_at_tau. *_with_tail prices each verify step at
the batch it still held (the forward costs also timed at batch 1, linear between), so achieved_over_ideal_with_tail
leaves the tail, which acceptance decides, out of the machinery's share.

--tp T (under torchrun): every rank builds the same engines, each holding its shard; rank 0 measures and prints
while the others run its steps. Without --spec the runtime alone is timed (transformers' model is not sharded).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from dataclasses import fields
from pathlib import Path

import torch

from infer.bench.forward_costs import ForwardCosts
from infer.bench.speedup import (SPEC_MIN_NEW_TOKENS, IdealShare, StepOverhead, compare, cost_context,
                                 ideal_speedup_with_tail, interleaved_stream, live_per_verify_step, recommend_k,
                                 timed_costs, timed_generate)
from infer.cli import (CliError, add_block_proposals_arg, add_engine_args, engine_kwargs, parse_floats,
                       parse_ints)
from infer.engine import Engine
from infer.loader import DTYPES
from infer.parallel import attach_where_it_lives, current, init_tp, on_rank0, serve_forever
from infer.prompts import DEFAULT_PROMPTS, read_prompt_file
from infer.sampling_params import SamplingParams


def best_of(repeats: int, run) -> tuple[float, int]:
    """The fastest of `repeats` runs: noise on a shared machine only ever adds time."""
    return min((run() for _ in range(repeats)), key=lambda result: result[0])


def run_engine(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    timed = timed_generate(engine, prompts, params)
    return timed.seconds, timed.tokens


def run_transformers(model, tokenizer, prompts: list[str], new_tokens: int,
                     stopping_criteria: list | None = None) -> tuple[float, int]:
    """transformers' generate on a left-padded batch, forced to exactly new_tokens tokens."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, stopping_criteria=stopping_criteria)
    return time.perf_counter() - start, (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


def run_alongside_transformers(engine: Engine, model, tokenizer, prompts: list[str],
                               new_tokens: int) -> tuple[tuple[float, int], tuple[float, int]]:
    """(seconds, tokens) of the engine and of transformers' generate on the same batch, their steps interleaved: a
    stopping criterion, which generate calls after each of its steps, steps the engine until its requests hold as
    many new tokens; the seconds spent there are the engine's, generate's others transformers'. Run after run, the
    two met different spells of this shared machine (`infer.bench.speedup.interleaved_generate`)."""
    from transformers import StoppingCriteria  # noqa: PLC0415 - the baseline only

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    ours = [0.0, 0.0]  # seconds stepping inside generate, after it

    def step_to(new: int, slot: int) -> None:
        if model.device.type == "cuda":
            torch.cuda.synchronize()  # transformers' queued kernels are its time
        start = time.perf_counter()
        while engine.has_unfinished() and min(len(r.output_ids) for r in requests) < new:
            engine.step()
        ours[slot] += time.perf_counter() - start

    class Alongside(StoppingCriteria):
        generated = 0  # generate calls it once per new token

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            self.generated += 1
            step_to(self.generated, 0)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    hf_s, hf_tokens = run_transformers(model, tokenizer, prompts, new_tokens, [Alongside()])
    step_to(new_tokens, 1)
    return (sum(ours), sum(len(r.output_ids) for r in requests)), (hf_s - ours[0], hf_tokens)


def bench_vs_transformers(args, prompts: list[str]) -> list[dict | None]:
    """Rows on rank 0 (None on the other ranks); under tensor parallelism without transformers' columns.

    tokens/s are the fastest runs'; the ratio is the median over `--repeats` interleaved pairs of runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - the baseline only

    hf = None
    if current().size == 1:
        hf = (AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype]).to(args.device).eval(),
              AutoTokenizer.from_pretrained(args.model))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def measure(engine: Engine, batch: list[str]) -> dict:
        run_engine(engine, batch[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        if hf is None:
            ours_s, ours_tokens = best_of(args.repeats, lambda: run_engine(engine, batch, params))
            return {"batch_size": len(batch), "runtime_tok_s": round(ours_tokens / ours_s, 1)}
        run_transformers(*hf, batch[:1], 4)
        pairs = [run_alongside_transformers(engine, *hf, batch, args.max_new_tokens) for _ in range(args.repeats)]
        tok_s = [(ours[1] / ours[0], theirs[1] / theirs[0]) for ours, theirs in pairs]
        return {"batch_size": len(batch), "runtime_tok_s": round(max(o for o, _ in tok_s), 1),
                "transformers_tok_s": round(max(t for _, t in tok_s), 1),
                "ratio": round(statistics.median(o / t for o, t in tok_s), 2),
                "ratio_range": f"{min(o / t for o, t in tok_s):.2f}-{max(o / t for o, t in tok_s):.2f}"}

    rows = []
    for batch_size in args.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        rows.append(on_rank0(functools.partial(measure, make_engine(args, batch_size), batch)))
    return rows


def make_engine(args, max_num_seqs: int) -> Engine:
    return Engine.from_pretrained(args.model, dtype=DTYPES[args.dtype], device=args.device,
                                  **engine_kwargs(args, max_num_seqs=max_num_seqs))


def with_drafter(args, engine: Engine, k: int) -> Engine:
    """Another engine on `engine`'s model, speculating K tokens with the --spec drafter (built where it lives)."""
    spec = engine.with_config()
    spec.num_draft_tokens = k
    attach_where_it_lives(args.spec, lambda: spec.load_drafter(args.spec, args.draft))
    return spec


def spec_row(plain: Engine, spec: Engine, batch: list[str], params: SamplingParams, repeats: int) -> dict:
    """One measured (temperature, batch size, K): speculative against plain decoding, and the ideal speedup."""
    warm_up = SamplingParams(max_new_tokens=4, ignore_eos=True)
    timed_generate(plain, batch[:1], warm_up)
    timed_generate(spec, batch[:1], warm_up)
    measured, between = timed_costs(spec, len(batch), params.max_new_tokens, alone=True)
    singles, between_single = timed_costs(spec, 1, params.max_new_tokens)  # the tail's price (below)

    def between_both(run) -> None:
        between(run)
        if len(batch) > 1:  # at batch 1 the costs above are batch 1's
            between_single(run)

    result = compare(plain, spec, batch, params, repeats, between_both)
    k = spec.num_draft_tokens
    context = cost_context([len(r.prompt_ids) for r in result.plain.requests], params.max_new_tokens)
    costs = ForwardCosts.fastest(measured)
    tau = result.stats["tau"]
    share = IdealShare.of(result, measured, k)
    alone = IdealShare.of(result, [c.alone() for c in measured], k)  # each model's forwards priced back to back
    live = live_per_verify_step(result.spec.requests)
    with_tail = IdealShare.of_ideals(result, [
        ideal_speedup_with_tail(live, params.max_new_tokens - 1, full, single, k)
        for full, single in zip(measured, singles if len(batch) > 1 else measured)])
    return {
        "temperature": params.temperature, "batch_size": len(batch), "k": k,
        "plain_tok_s": round(result.plain.tok_s, 1), "spec_tok_s": round(result.spec.tok_s, 1),
        "speedup": round(share.speedup, 3), "tau": tau,
        # a batch's requests accept differently: the last ones run steps of a shrinking batch that the ideal (every
        # step a full batch at the mean tau) does not count; steps_at_tau is what it counts
        "spec_steps": result.spec.steps, "steps_at_tau": 1 + math.ceil((params.max_new_tokens - 1) / tau),
        "acceptance_per_position": result.stats["acceptance_per_position"],
        "conditional_acceptance": result.stats["conditional_acceptance"],
        "ideal_speedup": round(share.ideal, 3), "achieved_over_ideal": round(share.achieved_over_ideal, 3),
        "cost_context": context, **{f"t_{name}_ms": ms for name, ms in costs.milliseconds().items()},
        "one_draft_forward": costs.one_forward,
        "ideal_speedup_alone": round(alone.ideal, 3), "achieved_over_ideal_alone": round(alone.achieved_over_ideal, 3),
        "ideal_speedup_with_tail": round(with_tail.ideal, 3),
        "achieved_over_ideal_with_tail": round(with_tail.achieved_over_ideal, 3),
        **result.step_split(),
    }


def bench_spec(args, prompts: list[str]) -> list[dict | None]:
    """Rows on rank 0 (None on the other ranks, which build the same engines and serve rank 0's steps)."""
    rows = []
    for temperature in args.temperatures:
        for batch_size in args.batch_sizes:
            batch = [prompts[i % len(prompts)] for i in range(batch_size)]
            params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=temperature)
            plain = make_engine(args, batch_size)
            for k in args.num_draft_tokens:
                spec = with_drafter(args, plain, k)
                rows.append(on_rank0(functools.partial(spec_row, plain, spec, batch, params, args.repeats)))
    return rows


def recommendations(rows: list[dict]) -> list[dict]:
    """Per temperature and batch size: the K that infer.bench.speedup recommends from the largest K's conditional
    acceptance and each K's measured forward costs, against the best K of the measured sweep (0 for both where
    plain decoding beats every K); the prediction checked at the K it ranks first."""
    out = []
    for key in sorted({(r["temperature"], r["batch_size"]) for r in rows}):
        sweep = {r["k"]: r for r in rows if (r["temperature"], r["batch_size"]) == key}
        largest = sweep[max(sweep)]
        costs = {k: ForwardCosts.from_milliseconds({f.name: r.get(f"t_{f.name}_ms") for f in fields(ForwardCosts)},
                                                   one_forward=r.get("one_draft_forward", False))
                 for k, r in sweep.items()}
        # the step overhead, fitted through the smallest and the largest K's runs only: the Ks between are a check
        ends = {k: (sweep[k]["plain_tok_s"], sweep[k]["spec_tok_s"], sweep[k]["tau"]) for k in (min(sweep), max(sweep))}
        overhead = StepOverhead.fitted(ends, costs, key[1])
        rec = recommend_k([a or 0.0 for a in largest["conditional_acceptance"]], costs, overhead)
        # each K against the plain run beside it (the machine drifts between rows)
        measured = {k: r["spec_tok_s"] / r["plain_tok_s"] for k, r in sweep.items()}
        best = max(measured, key=measured.get)
        checked = rec.best_k
        predicted = rec.predicted_speedup[checked] * sweep[checked]["plain_tok_s"]
        errors = [rec.predicted_speedup[k] / measured[k] - 1 for k in sweep]
        out.append({"temperature": key[0], "batch_size": key[1], "recommended_k": rec.k,
                    "measured_best_k": best if measured[best] > 1 else 0, "checked_k": checked,
                    "predicted_tok_s": round(predicted, 1), "measured_tok_s": sweep[checked]["spec_tok_s"],
                    "predicted_over_measured": round(predicted / sweep[checked]["spec_tok_s"], 3),
                    "worst_error_any_k": round(max(errors, key=abs), 3)})
    return out


def bench_arrivals(args, prompts: list[str]) -> dict | None:
    """A stream of requests: the share of decode steps that speculated (the others were plain because the drafter
    lagged or there was no room), and the mean time from a request's arrival to its last token against plain
    decoding. Requests arrive one every `--arrivals` steps of the plain engine; the speculative engine gets them at
    the same times on its own clock (arrivals counted in its own, longer and fewer steps would compare arrival
    schedules, not engines), the two engines' steps interleaved (`infer.bench.speedup.interleaved_stream`). The
    result on rank 0, None on the other ranks."""
    k, count = args.num_draft_tokens[-1], max(args.batch_sizes)
    plain = make_engine(args, count)
    spec = with_drafter(args, plain, k)
    return on_rank0(functools.partial(stream, args, prompts, plain, spec, k, count))


def stream(args, prompts: list[str], plain: Engine, spec: Engine, k: int, count: int) -> dict:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    runs = dict(zip(("plain", "spec"), interleaved_stream(plain, spec, prompts, params, count, args.arrivals)))
    result = {"arrive_every_steps": args.arrivals, "requests": count, "k": k}
    for name, run in runs.items():
        result[f"{name}_tok_s"] = round(run.tok_s, 1)
        result[f"{name}_latency_ms"] = round(1e3 * run.latency_s, 2)
    stats = spec.spec_stats.to_dict()
    result.update(speculated_share=stats["speculated_share"], tau=stats["tau"])
    result["latency_ratio"] = round(runs["spec"].latency_s / runs["plain"].latency_s, 3)
    return result


def print_table(rows: list[dict]) -> None:
    keys = [k for k in rows[0] if k not in ("acceptance_per_position", "conditional_acceptance")]
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for row in rows:
        print("  ".join(str(row[k]).rjust(w) for k, w in zip(keys, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--prompts", type=Path, help="JSONL prompts (default: built-in story openings)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved pairs of runs per measurement: tokens/s are the fastest run's, ratios the "
                             "median pair's (default 5)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--spec", choices=["none", "draft", "mtp", "block"], default="none",
                        help="benchmark speculative decoding with this drafter instead of comparing to transformers "
                             "(mtp: any head folder, its architecture picks the drafter; block: a block head, which "
                             "drafts K tokens from one forward, K up to its block_size - 1)")
    parser.add_argument("--draft", type=Path, help="draft LM folder (--spec draft) or head folder (--spec mtp, block)")
    parser.add_argument("--num-draft-tokens", default="1,2,3,4", help="comma-separated K values (default 1,2,3,4)")
    parser.add_argument("--temperatures", default="0", help="comma-separated temperatures for --spec (default 0)")
    add_block_proposals_arg(parser)
    parser.add_argument("--arrivals", type=int, default=4,
                        help="--spec: also run a stream of max(batch sizes) requests arriving one every N steps and "
                             "report the share of decode steps that speculated (default 4; 0: skip)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; run under torchrun --nproc_per_node TP")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    args.batch_sizes = parse_ints(args.batch_sizes, "--batch-sizes")
    args.num_draft_tokens = parse_ints(args.num_draft_tokens, "--num-draft-tokens")
    args.temperatures = parse_floats(args.temperatures, "--temperatures")
    if args.max_new_tokens < 1 or args.repeats < 1:
        raise CliError(f"--max-new-tokens and --repeats must be >= 1, got {args.max_new_tokens}, {args.repeats}")
    if args.spec != "none" and args.draft is None:
        raise CliError(f"--spec {args.spec} needs --draft DIR")
    if args.spec != "none" and args.max_new_tokens < SPEC_MIN_NEW_TOKENS:
        raise CliError(f"--spec needs --max-new-tokens >= {SPEC_MIN_NEW_TOKENS} (the prefill emits the first token, "
                       f"speculation starts at the second), got {args.max_new_tokens}")
    prompts = read_prompt_file(args.prompts) if args.prompts else DEFAULT_PROMPTS
    torch.manual_seed(0)
    if args.arrivals < 0:
        raise CliError(f"--arrivals must be >= 0, got {args.arrivals}")
    tp = init_tp(args.tp, args.device)
    rows = bench_spec(args, prompts) if args.spec != "none" else bench_vs_transformers(args, prompts)
    arrivals = bench_arrivals(args, prompts) if args.spec != "none" and args.arrivals else None
    if tp.rank > 0:  # it ran rank 0's steps on its shards: wait until rank 0 has reported
        serve_forever()
        return 0
    result = {"model": str(args.model), "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "tp": tp.size, "cuda_graphs": args.cuda_graphs, "overlap": args.overlap,
              "max_new_tokens": args.max_new_tokens, "spec": args.spec, "rows": rows}
    if args.spec != "none":
        result["recommendations"] = recommendations(rows)
        if arrivals:
            result["arrivals"] = arrivals
    if not args.json:
        print_table(rows)
        if args.spec != "none":
            print_table(result["recommendations"])
            if args.arrivals:
                print_table([result["arrivals"]])
    print(json.dumps(result))
    return 0

