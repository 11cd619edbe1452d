"""Validate a draft head where it will serve: infer's Engine with the head attached as its MTP drafter.

    python -m mtp_train.validate --target DIR --head DIR [--prompts FILE.jsonl] [--num-draft-tokens K]
        [--max-new-tokens N] [--temperatures 0,1] [--out DIR] [--run-dir RUN_DIR]
    python -m mtp_train.validate model=stories260k output_dir=outputs/stories260k-mtp   # the trainer's config
    python -m mtp_train.validate model.path=DIR head_dir=DIR prompts=FILE.jsonl          # the same, as overrides
    torchrun --nproc_per_node 8 -m mtp_train.validate --tp 8 --target DIR --head DIR   # a target sharded 8 ways

On held-out prompts, for each temperature (greedy and T=1 by default): acceptance per draft position, tau and the
accepted-length histogram; speculative against plain decoding timed in the same run, beside the ideal speedup
(`infer.speedup`). Once, on the prompts plus the plain engine's continuations: the head's KL to the target and
top-1 agreement, recomputed with infer's forward of the head. A trainer top-1 more than 2 points from the
runtime's greedy acceptance at position 0 sets `gap_flag`. docs/validation.md says what each figure means.

CLI outputs in --out (default ./validation): report.json and plots (mtp_train.report). Hydra: key=value arguments
compose conf/config.yaml as the trainer does; the target is model.path, the head head_dir (default
${output_dir}/head), the run dir output_dir, and prompts=FILE. Flags win over overrides.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from data_tools.config import ConfigError
from infer.attention import PackedCausalAttention
from infer.cli import CliError, run_cli
from infer.engine import Engine, ForwardCosts
from infer.kv_cache import pages_needed
from infer.loader import DTYPES
from infer.models.mtp_head import MTPHead, attach_to_target, copy_head, load_head
from infer.prompts import DEFAULT_PROMPTS, read_prompt_file
from infer.sampling_params import SamplingParams
from infer.parallel import group_of, init_tp, on_rank0, serve_forever, tp_main
from infer.speedup import (
    COST_CONTEXT, Comparison, StepOverhead, compare, costs_engine, ideal_speedup, recommend_k_by_batch,
    timed_generate,
)

GAP_POINTS = 0.02  # trainer top-1 vs runtime greedy acceptance at position 0


def serving_head(head: str | Path | MTPHead, model: nn.Module) -> MTPHead:
    """The head as the runtime serves it: loaded from its folder, or a copy of an in-memory head (the trainer's
    module is left as it is) attached to the target."""
    if isinstance(head, MTPHead):
        return attach_to_target(copy_head(head), model, where="the in-memory head")
    return load_head(head, model)


# --- the head's loss, recomputed with infer's forward ------------------------------------------------------------
@torch.inference_mode()
def aligned_logits(model: nn.Module, head: MTPHead, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(head logits [n-1, V] at positions 0..n-2, the target's logits [n-1, V] at positions 1..n-1): row i of both
    is a distribution over t_{i+2}. One sequence, no KV cache (PackedCausalAttention)."""
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    target_out = model(ids, positions, PackedCausalAttention([len(token_ids)]), [None] * len(model.model.layers))
    head_out = head(ids[1:], positions[:-1], PackedCausalAttention([len(token_ids) - 1]), [None],
                    hidden_states=head.target_input(target_out.hidden_states[:-1]))
    return head_out.logits, target_out.logits[1:]


def head_loss(model: nn.Module, head: MTPHead, sequences: list[list[int]]) -> dict:
    """Mean forward KL(target || head) and top-1 agreement over every head position of `sequences`."""
    if getattr(model.config, "model_type", None) != "llama" or head.mla:
        # the cache-free forward above passes Llama's [None] caches; MLA layers and DeepSeek targets take pairs
        return {"kl": None, "top1": None, "positions": 0, "note": "measured for Llama targets and heads"}
    kl_sum, agree, positions = 0.0, 0, 0
    for token_ids in sequences:
        if len(token_ids) < 2:
            continue
        head_logits, target_logits = aligned_logits(model, head, token_ids)
        log_p, log_q = F.log_softmax(target_logits.float(), -1), F.log_softmax(head_logits.float(), -1)
        kl_sum += float((log_p.exp() * (log_p - log_q)).sum())
        agree += int((head_logits.argmax(-1) == target_logits.argmax(-1)).sum())
        positions += head_logits.shape[0]
    n = max(positions, 1)
    return {"kl": kl_sum / n, "top1": agree / n, "positions": positions}


def merge_losses(losses: list[dict]) -> dict:
    """Position-weighted mean of per-temperature losses."""
    counted = [loss for loss in losses if loss["kl"] is not None and loss["positions"]]
    positions = sum(loss["positions"] for loss in counted)
    if not positions:
        return {"kl": None, "top1": None, "positions": 0}
    return {"kl": sum(loss["kl"] * loss["positions"] for loss in counted) / positions,
            "top1": sum(loss["top1"] * loss["positions"] for loss in counted) / positions, "positions": positions}


def top1_gap(trainer_top1: float | None, greedy_acceptance_0: float | None,
             threshold: float = GAP_POINTS) -> tuple[float | None, bool]:
    """(trainer top-1 minus runtime greedy acceptance at position 0, whether it is more than `threshold` apart)."""
    if trainer_top1 is None or greedy_acceptance_0 is None:
        return None, False
    gap = trainer_top1 - greedy_acceptance_0
    return gap, round(abs(gap), 9) > threshold  # rounding: 0.52 - 0.50 is exactly 2 points, not over


# --- speculative decoding, measured ----------------------------------------------------------------------------
def validate_head(
    target: str | Path | Engine,
    head: str | Path | MTPHead,
    prompts: list[str] | list[list[int]] | None = None,
    k: int = 4,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    max_new_tokens: int = 64,
    batch_size: int = 8,
    seed: int = 0,
    repeats: int = 2,
    trainer_top1: float | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    recommend_for: tuple[int, ...] = (1, 8, 32),
) -> dict | None:
    """Speculative decoding with `head` on `prompts` through infer's Engine, plus the head's loss (module doc).

    Under tensor parallelism (a target sharded over a group) every rank of the group calls this with the same
    arguments and builds the same engines; rank 0 measures and returns the report, the others return None.

    target: a model folder (loaded in dtype on device) or an Engine (its model, tokenizer, stop ids and settings).
    prompts: text (the target needs a tokenizer) or token ids; None: infer.prompts.DEFAULT_PROMPTS.
    trainer_top1 is a fraction in [0, 1]. recommend_for: batch sizes to recommend a K for (infer.speedup), from
    the greedy run's conditional acceptance (or the first run's); () skips it.
    """
    start = time.perf_counter()
    check_arguments(k, max_new_tokens, batch_size, repeats, trainer_top1)
    served = target if isinstance(target, Engine) else Engine.from_pretrained(target, dtype=dtype, device=str(device))
    model = served.model
    drafter = serving_head(head, model)
    prompt_ids = tokenize_prompts(served, prompts if prompts is not None else DEFAULT_PROMPTS)

    # Both engines get just the pages this batch needs (a default engine sizes for 64 full contexts).
    longest = max(max(map(len, prompt_ids)) + max_new_tokens, COST_CONTEXT) + k + 2
    sizes = dict(num_pages=batch_size * pages_needed(longest, served.config.page_size) + 1, max_num_seqs=batch_size,
                 num_draft_tokens=k)
    plain, spec = served.with_config(**sizes), served.with_config(**sizes)
    spec.attach_drafter("mtp", drafter)
    for_costs = costs_engine(spec, recommend_for) if recommend_for else None
    spec_k1 = None  # the step overhead is fitted through K and 1
    if recommend_for and k > 1:
        spec_k1 = served.with_config(**{**sizes, "num_draft_tokens": 1})
        spec_k1.attach_drafter("mtp", drafter)
    tp = group_of(model)

    def measure() -> tuple[list[dict], dict[float, list[list[int]]], dict, ForwardCosts]:
        """The timed runs (rank 0 alone under tensor parallelism: the other ranks serve its steps)."""
        warm_up = [SamplingParams(max_new_tokens=min(max_new_tokens, k + 4), ignore_eos=True)] * len(prompt_ids)
        timed_generate(plain, prompt_ids, warm_up)  # the batch's prefill shapes, and a few speculative steps
        timed_generate(spec, prompt_ids, warm_up)
        comparisons = {float(t): compare(plain, spec, prompt_ids, sampling_params(t, max_new_tokens, seed,
                                                                                  len(prompt_ids)), repeats)
                       for t in temperatures}
        runs = [run_record(t, max_new_tokens, result) for t, result in comparisons.items()]
        costs = spec.forward_costs(min(batch_size, len(prompt_ids)), COST_CONTEXT)
        for run in runs:
            run["ideal_speedup"] = round(ideal_speedup(run["tau"], costs, k), 3)
            run["achieved_over_ideal"] = round(run["speedup"] / run["ideal_speedup"], 3) if run["ideal_speedup"] else None
        basis = greedy_run(runs) or runs[0] if runs else None
        recommended = {}
        if for_costs is not None and basis:
            overhead = step_overhead(plain, spec_k1, prompt_ids, basis, comparisons[basis["temperature"]], costs)
            recommended = recommend_k_by_batch(for_costs, basis["conditional_acceptance"], recommend_for, overhead)
        sequences = {t: [r.token_ids for r in result.plain.requests] for t, result in comparisons.items()}
        return runs, sequences, recommended, costs

    measured = on_rank0(measure, tp)
    # The loss forwards are collective under tensor parallelism: every rank runs them on rank 0's sequences.
    sequences_by_temperature = tp.broadcast_object(measured[1] if measured else None)
    by_temperature = {f"{t:g}": head_loss(model, drafter, seqs) for t, seqs in sequences_by_temperature.items()}
    if measured is None:  # a rank > 0: rank 0 reports
        return None
    runs, _, recommended, costs = measured
    greedy = greedy_run(runs)
    basis = greedy or runs[0] if runs else None
    greedy_acceptance_0 = greedy["acceptance_per_position"][0] if greedy else None
    gap, flag = top1_gap(trainer_top1, greedy_acceptance_0)
    if flag:
        print(f"warning: trainer top-1 {trainer_top1:.4f} vs runtime greedy acceptance at position 0 "
              f"{greedy_acceptance_0:.4f}: {abs(gap) * 100:.1f} points apart (> {GAP_POINTS * 100:g}); training and "
              "serving may compute different functions", file=sys.stderr)
    param = next(model.parameters())
    return {
        "target": getattr(model.config, "_name_or_path", "") or "engine",
        "head": str(head) if not isinstance(head, MTPHead) else f"in-memory {head.config.architecture} head",
        "num_draft_tokens": k, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "num_prompts": len(prompt_ids), "seed": seed, "repeats": repeats,
        "device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "tp": tp.size,
        "runs": runs,
        "head_loss": {**merge_losses(list(by_temperature.values())), "by_temperature": by_temperature,
                      "on": "prompts + the plain engine's continuations at each temperature"},
        "forward_ms": {"decode": round(costs.decode * 1e3, 3), "draft": round(costs.draft * 1e3, 3),
                       "verify": round(costs.verify * 1e3, 3)},
        "recommended_k": {"by_batch_size": recommended,
                          "from": (f"T={basis['temperature']:g} conditional acceptance; step overhead measured at "
                                   f"batch {min(batch_size, len(prompt_ids))}") if recommended else None},
        "trainer_top1": trainer_top1, "greedy_acceptance_0": greedy_acceptance_0,
        "top1_gap": None if gap is None else round(gap, 4), "gap_flag": flag,
        "elapsed_s": round(time.perf_counter() - start, 3),
    }


def check_arguments(k: int, max_new_tokens: int, batch_size: int, repeats: int, trainer_top1: float | None) -> None:
    if not 1 <= k <= 16:
        raise ValueError(f"k (draft tokens per step) must be in 1..16, got {k}")
    if max_new_tokens < 1 or batch_size < 1 or repeats < 1:
        raise ValueError(f"max_new_tokens, batch_size and repeats must be >= 1, got {max_new_tokens}, {batch_size}, "
                         f"{repeats}")
    if trainer_top1 is not None and not 0.0 <= trainer_top1 <= 1.0:
        raise ValueError(f"trainer_top1 is a fraction in [0, 1], got {trainer_top1}")


def sampling_params(temperature: float, max_new_tokens: int, seed: int, count: int) -> list[SamplingParams]:
    """Fixed-length requests; prompt i samples with seed + i."""
    return [SamplingParams(temperature=float(temperature), max_new_tokens=max_new_tokens, ignore_eos=True,
                           seed=seed + i) for i in range(count)]


def run_record(temperature: float, max_new_tokens: int, result: Comparison) -> dict:
    """One temperature's line of the report: acceptance, tau and the timed speedup."""
    stats = result.stats
    return {
        "temperature": float(temperature), "max_new_tokens": max_new_tokens, "tau": stats["tau"],
        "acceptance_per_position": stats["acceptance_per_position"],
        "conditional_acceptance": stats["conditional_acceptance"],
        "conditional_acceptance_se": stats["conditional_acceptance_se"],
        "accepted_length_histogram": stats["accepted_length_histogram"], "verify_steps": stats["verify_steps"],
        "plain_tok_s": round(result.plain.tok_s, 1), "spec_tok_s": round(result.spec.tok_s, 1),
        "speedup": round(result.speedup, 3),
        "draft_time_s": stats["draft_time_s"], "verify_time_s": stats["verify_time_s"],
    }


def step_overhead(plain: Engine, spec_k1: Engine | None, prompt_ids: list[list[int]], basis: dict,
                  at_k: Comparison, costs: ForwardCosts) -> StepOverhead:
    """The per-step overhead at K (the validation's timed run) and at K=1 (one more short timed run on `spec_k1`,
    built beforehand on every rank), fitted as a line in K."""
    k, batch = at_k.stats["num_draft_tokens"], min(plain.config.max_num_seqs, len(prompt_ids))
    measured, all_costs = {k: at_k}, {k: costs}
    if spec_k1 is not None:
        params = sampling_params(basis["temperature"], basis["max_new_tokens"], 0, len(prompt_ids))
        timed_generate(spec_k1, prompt_ids, params)  # warm-up
        measured[1] = compare(plain, spec_k1, prompt_ids, params, repeats=1)
        all_costs[1] = spec_k1.forward_costs(batch, COST_CONTEXT)
    return StepOverhead.fitted({n: (c.plain.tok_s, c.spec.tok_s, c.stats["tau"]) for n, c in measured.items()},
                               all_costs, batch)


def greedy_run(runs: list[dict]) -> dict | None:
    return next((run for run in runs if run["temperature"] == 0.0), None)


def tokenize_prompts(served: Engine, prompts: list[str] | list[list[int]]) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts to validate on")
    if all(isinstance(p, str) for p in prompts):
        if served.tokenizer is None:
            raise ValueError("the target has no tokenizer: pass token ids as prompts")
        prompt_ids = [served.tokenizer.encode(p) for p in prompts]
    else:
        prompt_ids = [[int(t) for t in p] for p in prompts]
    context = served.max_model_len
    for i, ids in enumerate(prompt_ids):
        if not ids or len(ids) >= context:
            raise ValueError(f"prompt {i + 1} has {len(ids)} tokens; the target's context is {context} "
                             "(choose prompts that fit, with room to generate)")
    return prompt_ids


# --- command line ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, help="the target's Hugging Face folder (default: model.path)")
    parser.add_argument("--head", type=Path, help="the head folder (default: head_dir, else ${output_dir}/head)")
    parser.add_argument("--prompts", type=Path, help="JSONL prompts: 'prompt', 'text' or 'turns' (MT-bench, "
                                                     "Spec-Bench); default: built-in story openings")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="K, drafts per step (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (default 0,1)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests decoded together (default 8)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per measurement, the fastest counts (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed SEED + i (default 0)")
    parser.add_argument("--trainer-top1", type=float, help="the trainer's top-1 agreement in [0, 1] (default: the "
                                                           "latest eval top1_0 in RUN_DIR/metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="folder for report.json and the plots (default ./validation)")
    parser.add_argument("--run-dir", type=Path, help="training run folder: plots RUN_DIR/metrics.jsonl")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target and head dtype")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (tiny models on a busy CPU: 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks serving the target and the head; run "
                                                          "under torchrun --nproc_per_node TP")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Hydra overrides of conf/config.yaml (model=..., model.path=..., output_dir=..., "
                             "head_dir=..., prompts=...)")
    return parser


OWN_KEYS = ("head_dir", "prompts")  # validation's keys beside the trainer's config


def paths_from_config(overrides: list[str]) -> dict:
    """target, head, prompts and run dir from the trainer's config composed with `overrides`."""
    from mtp_train.config import compose_training  # noqa: PLC0415 - Hydra only when overrides are used

    own = {key: value for key, _, value in (o.partition("=") for o in overrides) if key in OWN_KEYS}
    rest = [o for o in overrides if o.partition("=")[0] not in OWN_KEYS]
    try:
        cfg = compose_training(rest, complete=False)  # features_dir is not needed here
    except ConfigError as err:
        raise CliError(f"overrides {' '.join(overrides)}: {err}") from err
    return {"target": Path(cfg.model.path), "head": Path(own.get("head_dir") or f"{cfg.output_dir}/head"),
            "prompts": Path(own["prompts"]) if own.get("prompts") else None, "run_dir": Path(cfg.output_dir)}


def main(argv: list[str] | None = None) -> int:
    from mtp_train.report import read_run_metrics, write_outputs, format_report  # noqa: PLC0415 - matplotlib

    args = build_parser().parse_intermixed_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise CliError(f"unexpected argument {bad[0]!r}: overrides are KEY=VALUE")
    needs_config = args.overrides or args.target is None or args.head is None
    from_config = paths_from_config(args.overrides) if needs_config else {}
    target, head = args.target or from_config.get("target"), args.head or from_config.get("head")
    prompts_file = args.prompts or from_config.get("prompts")
    run_dir = args.run_dir or from_config.get("run_dir")
    try:
        temperatures = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
    except ValueError as err:
        raise CliError(f"--temperatures takes comma-separated numbers, got {args.temperatures!r}") from err
    if not target.is_dir():
        raise CliError(f"target folder {target} does not exist")
    if not head.is_dir():
        raise CliError(f"head folder {head} does not exist")
    if run_dir is not None and args.run_dir is not None and not run_dir.is_dir():
        raise CliError(f"--run-dir {run_dir} does not exist")
    metrics = read_run_metrics(run_dir)
    trainer_top1, top1_source = args.trainer_top1, "--trainer-top1"
    if trainer_top1 is None and metrics.last_eval_top1 is not None:
        trainer_top1, top1_source = metrics.last_eval_top1, str(metrics.file)

    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    prompts = read_prompt_file(prompts_file) if prompts_file else DEFAULT_PROMPTS
    init_tp(args.tp, args.device)  # each rank loads its shard of the target and of the head
    report = validate_head(target, head, prompts, k=args.num_draft_tokens, temperatures=temperatures,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                           repeats=args.repeats, trainer_top1=trainer_top1, dtype=DTYPES[args.dtype],
                           device=args.device)
    if report is None:  # a rank > 0 (it ran rank 0's steps on its shards): wait until rank 0 has reported
        serve_forever()
        return 0
    report["prompts"] = str(prompts_file) if prompts_file else "built-in story openings"
    if trainer_top1 is not None:
        report["trainer_top1_source"] = top1_source
    print(format_report(report))
    write_outputs(report, args.out or Path("validation"), metrics)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(tp_main(main)))
