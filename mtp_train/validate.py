"""Validate a draft head where it will serve: infer's Engine with the head attached as its MTP drafter.

    python -m mtp_train.validate --target DIR --head DIR [--prompts FILE.jsonl] [--num-draft-tokens K]
        [--max-new-tokens N] [--temperatures 0,1] [--recommend-for 1,8,32] [--out DIR] [--run-dir RUN_DIR]

On held-out prompts (default: infer.prompts.VALIDATION_PROMPTS, 64 story openings, 128 new tokens each), for each
temperature (greedy and T=1 by default): the conditional acceptance at each draft position k (drafts accepted at k /
steps that reached k) with its standard error, the unconditional share (accepted at k / verify steps, labelled so),
tau (tokens per target forward while speculating) and the accepted-length histogram; speculative against plain
decoding timed in the same run, beside the ideal speedup (`infer.bench.speedup`). Once, on the plain engine's greedy
continuations: the trainer's own unroll (mtp_train.unroll: TTT attention, the head fed its own states) gives its
per-step top-1 and its conditional top-1 on the same text; more than 2 points between that and the runtime's
greedy conditional acceptance at any position sets `gap_flag`. docs/validation.md says what each figure means.

CLI outputs in --out (default ./validation): report.json and plots (mtp_train.report); a training run's folder is
--head RUN/head --run-dir RUN.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from infer.attention import PackedCausalAttention
from infer.bench.forward_costs import ForwardCosts
from infer.bench.speedup import (
    SPEC_MIN_NEW_TOKENS, TIMING_TOKENS, Comparison, IdealShare, TimingEngines, compare, cost_context,
    recommend_k_by_batch, timed_costs, timed_generate, timing_context, timing_engines,
)
from infer.cli import CliError, add_block_proposals_arg, parse_floats, parse_ints, run_cli
from infer.engine import Engine
from infer.kv_cache import pages_needed
from infer.loader import DTYPES, serve_lean
from infer.models.common import ModelOutput
from infer.models.block_head import BlockHead
from infer.models.mtp_head import DRAFTER_KINDS, DraftHead, attach_to_target, copy_head, load_head
from infer.parallel import group_of, init_tp, on_rank0, serve_forever, tp_main, whole_weight
from infer.prompts import VALIDATION_PROMPTS, read_prompt_file
from infer.sampling_params import SamplingParams
from mtp_train.block_unroll import BlockObjective, block_replay
from mtp_train.data import PackedBatch
from mtp_train.unroll import (
    LossWeights, UnrolledHead, batch_plan, per_step_means, replay_report, step_token_counts, verify_walk,
)

GAP_POINTS = 0.02  # trainer conditional top-1 vs runtime greedy conditional acceptance, per position


def serving_head(head: str | Path | DraftHead, model: nn.Module) -> DraftHead:
    """The head as the runtime serves it: loaded from its folder, or a copy of an in-memory head (the trainer's
    module is left as it is) attached to the target, lean as a loaded one."""
    if isinstance(head, DraftHead):
        return serve_lean(attach_to_target(copy_head(head), model, where="the in-memory head"))
    return load_head(head, model)


# --- the trainer's figures on the runtime's text -----------------------------------------------------------------
@torch.no_grad()
def packed_target_forward(model: nn.Module, token_ids: list[list[int]], aux_layers: tuple[int, ...]) -> ModelOutput:
    """The target over packed sequences with no KV cache: hidden states (and aux layers) at every position."""
    device = next(model.parameters()).device
    lens = [len(ids) for ids in token_ids]
    ids = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    caches = [(None, None) if model.config.model_type == "deepseek_v2" else None] * len(model.model.layers)
    return model(ids, positions, PackedCausalAttention(lens), caches, aux_layers=aux_layers)


@torch.no_grad()
def trainer_replay(model: nn.Module, head: DraftHead, sequences: list[list[int]], prompt_lens: list[int],
                   k: int) -> dict:
    """The trainer's figures on `sequences` (the plain engine's greedy outputs), from its own forward (UnrolledHead):

    top1 / cond_top1   per step over every anchor whose fed token is generated (per_step_means: what training
                       reports), teacher-forced / where the earlier steps agreed too;
    at_verify_steps    conditional top-1 at the anchors the greedy runtime verifies from: the first after the
                       prompt, then each one accepted drafts + 1 further. On a greedy text an accepted chain feeds the
                       drafter what the trainer feeds, so this is the runtime's conditional acceptance recomputed by
                       the trainer (drafts past the text's end are not counted)."""
    out = packed_target_forward(model, sequences, head.target_aux_layers)
    aux = (torch.stack([out.aux_hidden_states[i] for i in head.target_aux_layers], dim=1)
           if head.target_aux_layers else None)
    device = out.hidden_states.device
    mask = torch.cat([torch.arange(len(seq)) >= n for seq, n in zip(sequences, prompt_lens)]).to(device)
    lens = [len(seq) for seq in sequences]
    batch = PackedBatch(torch.tensor([t for seq in sequences for t in seq], device=device), out.hidden_states, mask,
                        lens, list(range(len(sequences))), aux)
    if isinstance(head, BlockHead):  # its own forward: blocks at every anchor (mtp_train.block_unroll)
        objective = BlockObjective(head, model.model.norm.weight, float(model.config.rms_norm_eps), LossWeights(),
                                   anchors_per_record=0, gamma=0.0)
        return block_replay(objective, batch, prompt_lens, k)
    plan = batch_plan(batch, k)
    counts = step_token_counts(batch, plan, k)
    shared = head.shared
    if group_of(model).size > 1:  # the loss scores whole lm_head rows: gather the vocabulary shards (every rank)
        lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False, device="meta")
        lm_head.weight = nn.Parameter(whole_weight(shared.lm_head), requires_grad=False)
        head.shared = dataclasses.replace(shared, lm_head=lm_head)
    try:
        objective = UnrolledHead(head, model.model.norm.weight, float(model.config.rms_norm_eps), k, LossWeights())
        _, stats, agreement = objective(batch, counts.to(device), plan, return_agreement=True)
    finally:
        head.shared = shared
    means = per_step_means(stats.cpu(), counts)
    per_record: list[list[list[bool]]] = [[[] for _ in range(k)] for _ in sequences]  # [record][step][anchor]
    for j, (step, agree) in enumerate(zip(plan, agreement)):
        for r, rows in zip(step.records, agree.split(step.seq_lens)):
            per_record[r][j] = rows.tolist()
    reached, accepted = [0] * k, [0] * k
    for agree, length, prompt_len in zip(per_record, lens, prompt_lens):  # an anchor i drafts t_{i+2}, ...
        verify_walk(lambda anchor, j, agree=agree: agree[j][anchor], prompt_len - 1, length, k, reached, accepted)
    return replay_report(means, accepted, reached, int(counts[0]), k)


def replay_gap(replay: dict, greedy_run: dict | None, threshold: float = GAP_POINTS) -> tuple[list[float], bool]:
    """(the trainer's conditional top-1 at the runtime's verify steps minus the runtime's greedy conditional
    acceptance, per position; whether any is more than `threshold` apart)."""
    if greedy_run is None:
        return [], False
    gaps = [round(t - r, 4) for t, r in zip(replay["at_verify_steps"], greedy_run["conditional_acceptance"])]
    return gaps, any(round(abs(g), 9) > threshold for g in gaps)  # rounding: exactly 2 points is not over


# --- speculative decoding, measured ----------------------------------------------------------------------------
@dataclasses.dataclass
class ValidationEngines:
    """Every engine a validation times, built up front: under tensor parallelism every rank builds them in the same
    order. Both timed engines get just the pages the batch needs (a default engine sizes for 64 full contexts)."""

    plain: Engine
    spec: Engine  # the head attached at K
    timing: TimingEngines | None  # sized for the timed runs and forward costs at every batch size a K is recommended for


def validation_engines(served: Engine, drafter: DraftHead, prompt_ids: list[list[int]], k: int, max_new_tokens: int,
                       batch_size: int, recommend_for: tuple[int, ...]) -> ValidationEngines:
    longest = timing_context(max(map(len, prompt_ids)) + max_new_tokens, k, served.config.decode_run_steps)
    sizes = dict(num_pages=batch_size * pages_needed(longest, served.config.page_size) + 1, max_num_seqs=batch_size,
                 num_draft_tokens=k)
    kind = DRAFTER_KINDS[drafter.config.architecture]
    plain, spec = served.with_config(**sizes), served.with_config(**sizes)
    spec.attach_drafter(kind, drafter)
    timing = timing_engines(spec, recommend_for, max(map(len, prompt_ids))) if recommend_for else None
    return ValidationEngines(plain, spec, timing)


class Measured(NamedTuple):
    runs: list[dict]  # one run_record per temperature, with its ideal speedup
    greedy_sequences: list[list[int]] | None  # the plain engine's greedy outputs (the trainer's replay reads them)
    recommended: dict  # recommend_k_by_batch's, {} when not asked for
    costs: ForwardCosts | None  # None: the ideal was not asked for
    cost_context: int  # cached tokens behind the timed forwards


def measure(engines: ValidationEngines, prompt_ids: list[list[int]], k: int, temperatures: tuple[float, ...],
            max_new_tokens: int, seed: int, repeats: int, recommend_for: tuple[int, ...], ideal: bool) -> Measured:
    """The timed runs (rank 0 alone under tensor parallelism: the other ranks serve its steps); ideal: the forward
    costs timed after each pair of runs, pricing the ideal speedup."""
    plain, spec = engines.plain, engines.spec
    warm_up = [SamplingParams(max_new_tokens=min(max_new_tokens, k + 4), ignore_eos=True)] * len(prompt_ids)
    timed_generate(plain, prompt_ids, warm_up)  # the batch's prefill shapes, and a few speculative steps
    timed_generate(spec, prompt_ids, warm_up)
    comparisons, runs, all_costs = {}, [], []
    for t in temperatures:
        measured, between = (timed_costs(spec, min(plain.config.max_num_seqs, len(prompt_ids)), max_new_tokens)
                             if ideal else ([], None))
        result = comparisons[float(t)] = compare(plain, spec, prompt_ids,
                                                 sampling_params(t, max_new_tokens, seed, len(prompt_ids)), repeats,
                                                 between)
        share = IdealShare.of(result, measured, k) if ideal else IdealShare.speedup_only(result)
        runs.append(run_record(t, max_new_tokens, result, share))
        all_costs += measured
    context = cost_context(map(len, prompt_ids), max_new_tokens)
    costs = ForwardCosts.fastest(all_costs) if all_costs else None
    basis = greedy_run(runs) or runs[0] if runs else None
    recommended = {}
    if engines.timing is not None and basis:
        recommended = recommend_k_by_batch(engines.timing, basis["conditional_acceptance"], recommend_for, prompt_ids,
                                           basis["temperature"])
    greedy = comparisons.get(0.0)
    return Measured(runs, [r.token_ids for r in greedy.plain.requests] if greedy else None, recommended, costs,
                    context)


def validate_head(
    target: str | Path | Engine,
    head: str | Path | DraftHead,
    prompts: list[str] | list[list[int]] | None = None,
    k: int = 4,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    max_new_tokens: int = 128,
    batch_size: int = 16,
    seed: int = 0,
    repeats: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    recommend_for: tuple[int, ...] = (1, 8, 32),
    ideal: bool = True,
) -> dict | None:
    """Speculative decoding with `head` on `prompts` through infer's Engine, and the trainer's figures on the text
    it produced (module doc).

    Under tensor parallelism (a target sharded over a group) every rank of the group calls this with the same
    arguments and builds the same engines; rank 0 measures and returns the report, the others return None.

    target: a model folder (loaded in dtype on device) or an Engine (its model, tokenizer, stop ids and settings).
    prompts: text (the target needs a tokenizer) or token ids; None: infer.prompts.VALIDATION_PROMPTS.
    recommend_for: batch sizes to recommend a K for (infer.bench.speedup), from the greedy run's conditional acceptance
    (or the first run's); () skips it.
    ideal: price each run's ideal speedup by forward costs timed beside it (most of a short validation's forwards);
    False leaves ideal_speedup, achieved_over_ideal and forward_ms out (None, {}): the trainer's validations log
    acceptance, tau and the speedup alone.
    """
    start = time.perf_counter()
    check_arguments(k, max_new_tokens, batch_size, repeats, temperatures)
    served = target if isinstance(target, Engine) else Engine.from_pretrained(target, dtype=dtype, device=str(device))
    model = served.model
    drafter = serving_head(head, model)
    prompt_ids = tokenize_prompts(served, prompts if prompts is not None else VALIDATION_PROMPTS)
    engines = validation_engines(served, drafter, prompt_ids, k, max_new_tokens, batch_size, recommend_for)
    tp = group_of(model)
    measured = on_rank0(lambda: measure(engines, prompt_ids, k, temperatures, max_new_tokens, seed, repeats,
                                        recommend_for, ideal), tp)
    # The trainer's replay runs the target and the head directly: under tensor parallelism every rank runs it on
    # rank 0's greedy sequences.
    greedy_sequences = tp.broadcast_object(measured.greedy_sequences if measured else None)
    replay = (trainer_replay(model, drafter, greedy_sequences, [len(p) for p in prompt_ids], k)
              if greedy_sequences is not None else None)
    if measured is None:  # a rank > 0: rank 0 reports
        return None
    runs, costs, recommended = measured.runs, measured.costs, measured.recommended
    greedy = greedy_run(runs)
    basis = greedy or runs[0] if runs else None
    gaps, flag = replay_gap(replay, greedy) if replay else ([], False)
    if flag:
        print(f"warning: the trainer's conditional top-1 {replay['at_verify_steps']} and the runtime's greedy "
              f"conditional acceptance {greedy['conditional_acceptance']} differ by more than {GAP_POINTS * 100:g} "
              "points at a position on the same text: training and serving compute different functions",
              file=sys.stderr)
    param = next(model.parameters())
    return {
        "target": getattr(model.config, "_name_or_path", "") or "engine",
        "head": str(head) if not isinstance(head, DraftHead) else f"in-memory {head.config.architecture} head",
        "architecture": drafter.config.architecture,
        "num_draft_tokens": k, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "num_prompts": len(prompt_ids), "distinct_prompts": len({tuple(p) for p in prompt_ids}), "seed": seed,
        "repeats": repeats, "device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "tp": tp.size,
        "runs": runs,
        "trainer_replay": replay, "replay_gap": gaps, "gap_flag": flag,
        "forward_ms": {name: ms for name, ms in costs.milliseconds().items() if ms is not None} if costs else {},
        "forward_context_tokens": measured.cost_context if costs else None,  # cached behind those forwards
        "recommended_k": {"by_batch_size": recommended,
                          "from": (f"T={basis['temperature']:g} conditional acceptance; forward costs and step "
                                   f"overhead measured at each batch size ({TIMING_TOKENS}-token runs at K and 1)")
                                  if recommended else None},
        "elapsed_s": round(time.perf_counter() - start, 3),
    }


def check_arguments(k: int, max_new_tokens: int, batch_size: int, repeats: int,
                    temperatures: tuple[float, ...]) -> None:
    if not temperatures:
        raise ValueError("no temperature to validate at: give at least one (e.g. 0 for greedy)")
    if not 1 <= k <= 16:
        raise ValueError(f"k (draft tokens per step) must be in 1..16, got {k}")
    if max_new_tokens < SPEC_MIN_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be >= {SPEC_MIN_NEW_TOKENS} (the prefill emits the first token, "
                         f"speculation starts at the second), got {max_new_tokens}")
    if batch_size < 1 or repeats < 1:
        raise ValueError(f"batch_size and repeats must be >= 1, got {batch_size}, {repeats}")


def sampling_params(temperature: float, max_new_tokens: int, seed: int, count: int) -> list[SamplingParams]:
    """Fixed-length requests; prompt i samples with seed + i."""
    return [SamplingParams(temperature=float(temperature), max_new_tokens=max_new_tokens, ignore_eos=True,
                           seed=seed + i) for i in range(count)]


def run_record(temperature: float, max_new_tokens: int, result: Comparison, share: IdealShare) -> dict:
    """One temperature's line of the report: conditional acceptance (and the unconditional share, labelled so),
    tau, the timed speedup and its ideal (medians over the repeats, `IdealShare`; None where none was priced), the
    fastest runs' steps split into forwards and host work (`Comparison.step_split`)."""
    stats = result.stats
    rounded = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {
        "temperature": float(temperature), "max_new_tokens": max_new_tokens, "tau": stats["tau"],
        "conditional_acceptance": stats["conditional_acceptance"],
        "conditional_acceptance_se": stats["conditional_acceptance_se"], "reached": stats["reached"],
        "unconditional_acceptance": stats["acceptance_per_position"],
        "accepted_length_histogram": stats["accepted_length_histogram"], "verify_steps": stats["verify_steps"],
        "plain_tok_s": round(result.plain.tok_s, 1), "spec_tok_s": round(result.spec.tok_s, 1),
        "speedup": round(share.speedup, 3), "ideal_speedup": rounded(share.ideal),
        "achieved_over_ideal": rounded(share.achieved_over_ideal),
        "draft_time_s": stats["draft_time_s"], "verify_time_s": stats["verify_time_s"],
        **result.step_split(),
    }


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
    parser.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder")
    parser.add_argument("--head", type=Path, required=True, help="the head folder (a training run's RUN/head)")
    parser.add_argument("--prompts", type=Path, help="JSONL prompts: 'prompt', 'text' or 'turns' (MT-bench, "
                                                     "Spec-Bench); default: 64 held-out story openings")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="K, drafts per step (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures (default 0,1)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests decoded together (default 16)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per measurement, the fastest counts (default 2)")
    parser.add_argument("--recommend-for", default="1,8,32", metavar="BATCH_SIZES",
                        help="comma-separated batch sizes to recommend a K for, from forward costs and step overhead "
                             "timed at each (the exported head's recommended_k); 'none' skips it (default 1,8,32)")
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed SEED + i (default 0)")
    parser.add_argument("--out", type=Path, help="folder for report.json and the plots (default ./validation)")
    parser.add_argument("--run-dir", type=Path, help="training run folder: plots RUN_DIR/metrics.jsonl")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target and head dtype")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (tiny models on a busy CPU: 1)")
    add_block_proposals_arg(parser)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks serving the target and the head; run "
                                                          "under torchrun --nproc_per_node TP")
    return parser


def main(argv: list[str] | None = None) -> int:
    from mtp_train.report import read_run_metrics, write_outputs, format_report  # noqa: PLC0415 - matplotlib

    args = build_parser().parse_args(argv)
    target, head, prompts_file, run_dir = args.target, args.head, args.prompts, args.run_dir
    temperatures = tuple(parse_floats(args.temperatures, "--temperatures"))
    recommend_for = () if args.recommend_for.strip().lower() == "none" else tuple(
        parse_ints(args.recommend_for, "--recommend-for"))
    if not target.is_dir():
        raise CliError(f"target folder {target} does not exist")
    if not head.is_dir():
        raise CliError(f"head folder {head} does not exist")
    if run_dir is not None and not run_dir.is_dir():
        raise CliError(f"--run-dir {run_dir} does not exist")
    metrics = read_run_metrics(run_dir)

    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    prompts = read_prompt_file(prompts_file) if prompts_file else VALIDATION_PROMPTS
    init_tp(args.tp, args.device)  # each rank loads its shard of the target and of the head
    served = Engine.from_pretrained(target, dtype=DTYPES[args.dtype], device=args.device,
                                    block_proposals=args.block_proposals)
    report = validate_head(served, head, prompts, k=args.num_draft_tokens, temperatures=temperatures,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                           repeats=args.repeats, dtype=DTYPES[args.dtype], device=args.device,
                           recommend_for=recommend_for)
    if report is None:  # a rank > 0 (it ran rank 0's steps on its shards): wait until rank 0 has reported
        serve_forever()
        return 0
    report["prompts"] = str(prompts_file) if prompts_file else "64 held-out story openings (VALIDATION_PROMPTS)"
    print(format_report(report))
    write_outputs(report, args.out or Path("validation"), metrics)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(tp_main(main)))
