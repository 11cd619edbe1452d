"""Validate a draft head where it will serve: infer's Engine with the head attached as its MTP drafter.

    python -m mtp_train.validate --target DIR --head DIR [--prompts FILE.jsonl] [--num-draft-tokens K]
        [--max-new-tokens N] [--temperatures 0,1] [--out DIR] [--run-dir RUN_DIR]
    python -m mtp_train.validate model=stories260k output_dir=outputs/stories260k-mtp   # the trainer's config
    python -m mtp_train.validate model.path=DIR head_dir=DIR prompts=FILE.jsonl          # the same, as overrides

On held-out prompts, for each temperature (greedy and T=1 by default), one call measures:
  - acceptance per draft position, tau (tokens per target step) and the accepted-length histogram;
  - the speedup of speculative over plain decoding, both measured in this run on the same prompts and sampling
    parameters (fixed output length, the fastest of `repeats` runs), and the ideal speedup that the measured
    acceptance and forward costs allow (infer.bench's formula), so the two can be read together;
and once, on the prompts plus the plain engine's continuations at every temperature, the validation loss
recomputed with infer's forward of the head (PackedCausalAttention, the layer code the runtime serves): on a
sequence t_0..t_{n-1} the target gives h_i and p(. | t_0..t_i) at each i; the head at i reads (t_{i+1}, h_i) and
its distribution q_i over t_{i+2} is compared with the target's at i+1:
    KL_i = sum_v p_{i+1}(v) (log p_{i+1}(v) - log q_i(v)),   top1_i = [argmax q_i == argmax p_{i+1}],
averaged over every i in 0..n-2 of every sequence.

Training/serving gap: the trainer's top-1 agreement (its eval `top1_0`) and the runtime's greedy acceptance at
draft position 0 are the same event (the head's argmax equals the target's), so they should agree up to the
difference between the trainer's eval data and these prompts. More than 2 points apart sets `gap_flag` and
prints a warning: training and serving may compute different functions.

The trainer calls `validate_head` at each evaluation with its in-memory head: the head is copied onto the
target's device and dtype and attached to the target's own embedding and lm_head, which is what save_head +
load_head would serve; the trainer's module is not touched. Under ZeRO-3 gather the head's parameters first.

CLI outputs in --out (default ./validation): report.json, acceptance_per_position.png,
accepted_length_histogram.png and, when --run-dir holds metrics.jsonl, training_curves.png (see mtp_train.plots
for the metrics lines read). Without --trainer-top1 the run's latest eval top1_0 is used for the gap check.
Hydra: key=value arguments compose conf/config.yaml as the trainer does; the target is model.path, the head
head_dir (default ${output_dir}/head), the run dir output_dir, and prompts=FILE is read too. Flags win over
overrides.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infer.attention import PackedCausalAttention
from infer.bench import forward_cost
from infer.cli import DTYPES, CliError, run_cli
from infer.engine import Engine, EngineConfig, default_eos_ids
from infer.generate import read_prompt_file
from infer.kv_cache import pages_needed
from infer.loader import load_model
from infer.models.mtp_head import HeadLoadError, MTPHead, SharedTargetWeights, check_target, load_head
from infer.sampling_params import SamplingParams
from infer.speculative import SpecStats

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GAP_POINTS = 0.02  # trainer top-1 vs runtime greedy acceptance at position 0
COST_CONTEXT = 32  # cached tokens behind the timed single forwards (infer.bench uses the same)

# Story openings for TinyStories-like targets (stories260K): MT-bench questions mean nothing to such a model.
DEFAULT_PROMPTS = [
    "Once upon a time, there was a little dog named Max.",
    "Lily and her mom went to the beach on a sunny day.",
    "One day, Tim found a shiny red ball in the garden.",
    "The little bird wanted to fly high in the sky.",
    "Sara had a big box of crayons and a new book.",
    "There was a small boat on the lake near the woods.",
    "Ben liked to help his dad in the kitchen.",
    "Anna saw a cat sitting on the fence.",
]


@dataclass
class ServingTarget:
    """The target model and what the engine needs beside it."""

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase | None
    eos_token_ids: frozenset[int]
    name: str
    engine_config: EngineConfig


def load_target(target: str | Path | Engine | nn.Module, tokenizer: PreTrainedTokenizerBase | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> ServingTarget:
    """A target folder, an Engine (its model, tokenizer, eos ids and engine settings) or a loaded infer model."""
    if isinstance(target, Engine):
        return ServingTarget(target.model, tokenizer or target.tokenizer, target.eos_token_ids,
                             getattr(target.model.config, "_name_or_path", "") or "engine", target.config)
    if isinstance(target, nn.Module):
        eos = getattr(target.config, "eos_token_id", None)
        eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        return ServingTarget(target, tokenizer, eos_ids, getattr(target.config, "_name_or_path", "") or "model",
                             EngineConfig())
    path = Path(target)
    model = load_model(path, dtype=dtype, device=device)  # ModelLoadError names a missing folder or file
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if tokenizer is None and any((path / name).is_file() for name in tokenizer_files):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return ServingTarget(model, tokenizer, frozenset(default_eos_ids(path, model.config)), str(path), EngineConfig())


def serving_head(head: str | Path | MTPHead, model: nn.Module) -> MTPHead:
    """The head as the runtime serves it: loaded from its folder, or an in-memory head copied onto the target's
    device and dtype and attached to the target's own embedding and lm_head."""
    if not isinstance(head, MTPHead):
        path = Path(head)
        if not path.is_dir():
            raise HeadLoadError(f"head folder {path} does not exist")
        return load_head(path, model)
    config = head.config
    check_target(config, model, "the in-memory head")
    copy = MTPHead(config)
    copy.load_state_dict({name: tensor.detach() for name, tensor in head.state_dict().items()})
    param = next(model.parameters())
    copy = copy.to(device=param.device, dtype=param.dtype).eval().requires_grad_(False)
    return copy.attach(SharedTargetWeights(model.model.embed_tokens, model.lm_head))


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
                    hidden_states=target_out.hidden_states[:-1])
    return head_out.logits, target_out.logits[1:]


def head_loss(model: nn.Module, head: MTPHead, sequences: list[list[int]]) -> dict:
    """Mean forward KL(target || head) and top-1 agreement over every head position of `sequences`."""
    if getattr(model.config, "model_type", None) != "llama" or head.mla:
        # PackedCausalAttention has no MLA kernel (attend_mla), so DeepSeek targets and heads are not covered here.
        return {"kl": None, "top1": None, "positions": 0, "note": "needs a Llama target and head (no packed MLA)"}
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


def top1_gap(trainer_top1: float | None, greedy_acceptance_0: float | None,
             threshold: float = GAP_POINTS) -> tuple[float | None, bool]:
    """(trainer top-1 minus runtime greedy acceptance at position 0, whether it is more than `threshold` apart)."""
    if trainer_top1 is None or greedy_acceptance_0 is None:
        return None, False
    gap = trainer_top1 - greedy_acceptance_0
    return gap, round(abs(gap), 9) > threshold  # rounding: 0.52 - 0.50 is exactly 2 points, not over


# --- speculative decoding, timed ------------------------------------------------------------------------------------
def timed_generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, list]:
    """(seconds, generated tokens, the requests) for one batch run to completion."""
    start = time.perf_counter()
    requests = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(r.output_ids) for r in requests), requests


def validate_head(
    target: str | Path | Engine | nn.Module,
    head: str | Path | MTPHead,
    prompts: list[str] | list[list[int]] | None = None,
    k: int = 4,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    max_new_tokens: int = 64,
    batch_size: int = 8,
    seed: int = 0,
    repeats: int = 2,
    trainer_top1: float | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Speculative decoding with `head` on `prompts` through infer's Engine, plus the head's loss; see the module doc.

    prompts: text (the target needs a tokenizer) or token ids; None: DEFAULT_PROMPTS. dtype/device apply only when
    `target` is a folder. trainer_top1 is a fraction in [0, 1].
    """
    start = time.perf_counter()
    if not 1 <= k <= 16:
        raise ValueError(f"k (draft tokens per step) must be in 1..16, got {k}")
    if max_new_tokens < 1 or batch_size < 1 or repeats < 1:
        raise ValueError(f"max_new_tokens, batch_size and repeats must be >= 1, got {max_new_tokens}, {batch_size}, "
                         f"{repeats}")
    if trainer_top1 is not None and not 0.0 <= trainer_top1 <= 1.0:
        raise ValueError(f"trainer_top1 is a fraction in [0, 1], got {trainer_top1}")
    served = load_target(target, tokenizer, dtype, device)
    model = served.model
    drafter = serving_head(head, model)
    prompt_ids = tokenize(served, prompts if prompts is not None else DEFAULT_PROMPTS)

    # Both engines get just the pages this batch needs (a default engine sizes for 64 full contexts).
    page_size = served.engine_config.page_size
    longest = max(max(map(len, prompt_ids)) + max_new_tokens, COST_CONTEXT) + k + 2
    config = replace(served.engine_config, num_pages=batch_size * pages_needed(longest, page_size) + 1,
                     max_num_seqs=batch_size, num_draft_tokens=k)
    plain = Engine(model, served.tokenizer, served.eos_token_ids, config)
    spec = Engine(model, served.tokenizer, served.eos_token_ids, config)
    spec.attach_drafter("mtp", drafter)
    warm_up = [SamplingParams(max_new_tokens=min(max_new_tokens, k + 4), ignore_eos=True)] * len(prompt_ids)
    timed_generate(plain, prompt_ids, warm_up)  # the batch's prefill shapes, and a few speculative steps
    timed_generate(spec, prompt_ids, warm_up)

    runs, sequences_by_temperature = [], {}
    for temperature in temperatures:
        params = [SamplingParams(temperature=float(temperature), max_new_tokens=max_new_tokens, ignore_eos=True,
                                 seed=seed + i) for i in range(len(prompt_ids))]
        spec.spec_stats = SpecStats(k)  # count the timed runs only
        plain_results, spec_results = [], []
        for _ in range(repeats):  # interleaved, so that a burst of load on a shared machine hits both
            plain_results.append(timed_generate(plain, prompt_ids, params))
            spec_results.append(timed_generate(spec, prompt_ids, params))
        plain_s, plain_tokens, plain_requests = min(plain_results, key=lambda r: r[0])
        spec_s, spec_tokens, _ = min(spec_results, key=lambda r: r[0])
        stats = spec.spec_stats.to_dict()
        sequences_by_temperature[float(temperature)] = [r.token_ids for r in plain_requests]
        runs.append({
            "temperature": float(temperature), "tau": stats["tau"],
            "acceptance_per_position": stats["acceptance_per_position"],
            "accepted_length_histogram": stats["accepted_length_histogram"], "verify_steps": stats["verify_steps"],
            "plain_tok_s": round(plain_tokens / plain_s, 1), "spec_tok_s": round(spec_tokens / spec_s, 1),
            "speedup": round((spec_tokens / spec_s) / (plain_tokens / plain_s), 3),
            "draft_time_s": stats["draft_time_s"], "verify_time_s": stats["verify_time_s"],
        })

    # Forward costs behind the ideal speedup: tau * t(decode) / (K * t(draft) + t(verify over K+1)).
    batch = min(batch_size, len(prompt_ids))
    hidden = torch.zeros(1, model.config.hidden_size, device=spec.device, dtype=spec.drafter.runner.dtype)
    t_decode = forward_cost(plain.runner, plain, batch, 1, COST_CONTEXT)
    t_draft = forward_cost(spec.drafter.runner, spec, batch, 1, COST_CONTEXT, hidden_states=hidden)
    t_verify = forward_cost(spec.runner, spec, batch, k + 1, COST_CONTEXT)
    for run in runs:
        run["ideal_speedup"] = round(run["tau"] * t_decode / (k * t_draft + t_verify), 3)
        run["achieved_over_ideal"] = round(run["speedup"] / run["ideal_speedup"], 3) if run["ideal_speedup"] else None

    by_temperature = {f"{t:g}": head_loss(model, drafter, seqs) for t, seqs in sequences_by_temperature.items()}
    loss = merge_losses(list(by_temperature.values()))
    greedy = next((run for run in runs if run["temperature"] == 0.0), None)
    greedy_acceptance_0 = greedy["acceptance_per_position"][0] if greedy else None
    gap, flag = top1_gap(trainer_top1, greedy_acceptance_0)
    if flag:
        print(f"warning: trainer top-1 {trainer_top1:.4f} vs runtime greedy acceptance at position 0 "
              f"{greedy_acceptance_0:.4f}: {abs(gap) * 100:.1f} points apart (> {GAP_POINTS * 100:g}); training and "
              "serving may compute different functions", file=sys.stderr)
    param = next(model.parameters())
    return {
        "target": served.name, "head": head_name(head), "num_draft_tokens": k, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "num_prompts": len(prompt_ids), "seed": seed, "repeats": repeats,
        "device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "runs": runs,
        "head_loss": {**loss, "by_temperature": by_temperature,
                      "on": "prompts + the plain engine's continuations at each temperature"},
        "forward_ms": {"decode": round(t_decode * 1e3, 3), "draft": round(t_draft * 1e3, 3),
                       "verify": round(t_verify * 1e3, 3)},
        "trainer_top1": trainer_top1, "greedy_acceptance_0": greedy_acceptance_0,
        "top1_gap": None if gap is None else round(gap, 4), "gap_flag": flag,
        "elapsed_s": round(time.perf_counter() - start, 3),
    }


def tokenize(served: ServingTarget, prompts: list[str] | list[list[int]]) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts to validate on")
    if all(isinstance(p, str) for p in prompts):
        if served.tokenizer is None:
            raise ValueError("the target has no tokenizer: pass token ids as prompts, or a tokenizer")
        prompt_ids = [served.tokenizer.encode(p) for p in prompts]
    else:
        prompt_ids = [[int(t) for t in p] for p in prompts]
    context = served.model.config.max_position_embeddings
    for i, ids in enumerate(prompt_ids):
        if not ids or len(ids) >= context:
            raise ValueError(f"prompt {i + 1} has {len(ids)} tokens; the target's context is {context} "
                             "(choose prompts that fit, with room to generate)")
    return prompt_ids


def merge_losses(losses: list[dict]) -> dict:
    """Position-weighted mean of per-temperature losses."""
    counted = [loss for loss in losses if loss["kl"] is not None and loss["positions"]]
    positions = sum(loss["positions"] for loss in counted)
    if not positions:
        return {"kl": None, "top1": None, "positions": 0}
    return {"kl": sum(loss["kl"] * loss["positions"] for loss in counted) / positions,
            "top1": sum(loss["top1"] * loss["positions"] for loss in counted) / positions, "positions": positions}


def head_name(head: str | Path | MTPHead) -> str:
    if isinstance(head, MTPHead):
        return f"in-memory {head.config.architecture} head"
    return str(head)


def format_report(report: dict) -> str:
    """The runs as a table, then the loss and the gap check."""
    k = report["num_draft_tokens"]
    columns = ["T", "tau", *[f"acc@{j + 1}" for j in range(k)], "speedup", "ideal", "plain tok/s", "spec tok/s"]
    rows = [[f"{run['temperature']:g}", f"{run['tau']:.3f}", *[f"{a:.3f}" for a in run["acceptance_per_position"]],
             f"{run['speedup']:.3f}", f"{run['ideal_speedup']:.3f}", f"{run['plain_tok_s']:.1f}",
             f"{run['spec_tok_s']:.1f}"]
            for run in report["runs"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    loss = report["head_loss"]
    if loss["kl"] is not None:
        lines.append(f"head vs target (infer forward, {loss['positions']} positions): KL {loss['kl']:.4f}, "
                     f"top-1 {loss['top1']:.4f}")
    if report["top1_gap"] is not None:
        flag = "  GAP" if report["gap_flag"] else ""
        lines.append(f"trainer top-1 {report['trainer_top1']:.4f} - runtime greedy acc@1 "
                     f"{report['greedy_acceptance_0']:.4f} = {report['top1_gap']:+.4f}{flag}")
    return "\n".join(lines)


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
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Hydra overrides of conf/config.yaml (model=..., model.path=..., output_dir=..., "
                             "head_dir=..., prompts=...)")
    return parser


def compose_overrides(overrides: list[str]) -> dict:
    """target, head, prompts and run dir from the trainer's config composed with `overrides`."""
    if not (CONF_DIR / "config.yaml").is_file():
        raise CliError(f"key=value overrides need {CONF_DIR / 'config.yaml'}, which is missing")
    from hydra import compose, initialize_config_dir  # noqa: PLC0415 - only when overrides are used
    from hydra.errors import HydraException  # noqa: PLC0415
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    own_keys = ("head_dir", "prompts")  # not in the trainer's config: added with Hydra's '+'
    fixed = [f"+{o}" if o.split("=", 1)[0] in own_keys else o for o in overrides]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=fixed)
        output_dir = str(cfg.output_dir)
        return {"target": Path(str(cfg.model.path)), "head": Path(str(cfg.get("head_dir") or f"{output_dir}/head")),
                "prompts": Path(str(cfg.prompts)) if cfg.get("prompts") else None, "run_dir": Path(output_dir)}
    except (HydraException, OmegaConfBaseException) as err:
        raise CliError(f"overrides {' '.join(overrides)}: {str(err).splitlines()[0]}") from err


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise CliError(f"unexpected argument {bad[0]!r}: overrides are KEY=VALUE")
    needs_config = args.overrides or args.target is None or args.head is None
    from_config = compose_overrides(args.overrides) if needs_config else {}
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

    records, skipped = [], 0
    metrics_file = run_dir / "metrics.jsonl" if run_dir else None
    if run_dir is not None and args.run_dir is not None and not run_dir.is_dir():
        raise CliError(f"--run-dir {run_dir} does not exist")
    if metrics_file is not None and metrics_file.is_file():
        from mtp_train.plots import read_metrics  # noqa: PLC0415

        records, skipped = read_metrics(metrics_file)
    trainer_top1, top1_source = args.trainer_top1, "--trainer-top1"
    if trainer_top1 is None and records:
        from mtp_train.plots import last_eval_top1  # noqa: PLC0415

        trainer_top1, top1_source = last_eval_top1(records), str(metrics_file)

    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    prompts = read_prompt_file(prompts_file) if prompts_file else DEFAULT_PROMPTS
    report = validate_head(target, head, prompts, k=args.num_draft_tokens, temperatures=temperatures,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                           repeats=args.repeats, trainer_top1=trainer_top1, dtype=DTYPES[args.dtype],
                           device=args.device)
    report["prompts"] = str(prompts_file) if prompts_file else "built-in story openings"
    if trainer_top1 is not None:
        report["trainer_top1_source"] = top1_source
    print(format_report(report))
    write_outputs(report, args.out or Path("validation"), records, skipped, metrics_file)
    return 0


def write_outputs(report: dict, out: Path, records: list[dict], skipped: int, metrics_file: Path | None) -> None:
    from mtp_train.plots import plot_accepted_lengths, plot_acceptance, plot_training_curves  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    plots = [plot_acceptance(report["runs"], out / "acceptance_per_position.png"),
             plot_accepted_lengths(report["runs"], out / "accepted_length_histogram.png")]
    if records:
        curves = plot_training_curves(records, out / "training_curves.png")
        plots += [curves] if curves else []
        report["metrics"] = {"file": str(metrics_file), "records": len(records), "skipped_lines": skipped}
    report["plots"] = [p.name for p in plots]
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'report.json'} and {', '.join(report['plots'])}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
