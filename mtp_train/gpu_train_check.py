"""The GPU check's training rows (launch/gpu_check.sh): online EAGLE-3 training of a head for a Llama-3.2-1B-shaped
bf16 target (random weights, stories260K's tokenizer) on one GPU under DeepSpeed (nccl, bf16), and the same run on
features precomputed on the GPU first, for the ratio.

    python -m mtp_train.gpu_train_check --stories DIR [--steps 300] [--work DIR]
    python -m mtp_train.gpu_train_check --stories DIR --target DIR --device cpu --steps 30   # the plumbing, on a CPU

Per run: tokens/s over the steps after the first `--warmup`, the step's split (trainer.time_phases: the target's
forwards or the feature reads, the head's forward and backward, the optimizer), the head's MFU (its model FLOPs
over the GPU's dense bf16 peak) and the peak of GPU memory; printed as rows of the check's table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infer.cli import run_cli

# dense bf16 peak FLOP/s by device name (NVIDIA's datasheets, SXM parts): the MFU's denominator
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def common_overrides(model: Path, steps: int, device: str, shaped: bool) -> list[str]:
    """Both runs' settings: the 1B-shaped target's conf/model (its recipe) unless another target is given."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    return [f"model.path={model}", *(["model=llama3_2_1b"] if shaped else []), "head=eagle3", "data=sharegpt_dummy",
            "data.max_length=512", f"trainer.device={device}", f"trainer.dtype={dtype}", f"online.model_dtype={dtype}",
            f"online.dtype={dtype}", f"trainer.max_steps={steps}", "trainer.micro_batch_size=4",
            "trainer.seq_len=512", "trainer.grad_accum=1", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.progress=false", "trainer.time_phases=true", "eval_records=8", "validate.enabled=false",
            "head.draft_vocab_tokens=100000"]


def head_flops_per_token(summary: dict, run: dict) -> float:
    """The head's model FLOPs per trained token: K unroll steps of forward and backward over its trainable
    parameters (6 P) and the frozen lm_head rows of the draft vocabulary (forward and input gradient, 4 H Vd), plus
    the target's distribution over the draft vocabulary once (2 H Vd). Attention's score FLOPs are left out."""
    hidden, vocab, k = run["hidden"], run["draft_vocab"], run["unroll_steps"]
    return k * (6 * summary["trainable_params"] + 4 * hidden * vocab) + 2 * hidden * vocab


def measure(records: list[dict], warmup: int) -> dict:
    """tokens/s and the mean split per step (seconds) over the steps after warmup."""
    steady = [r for r in records if r["step"] > warmup]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steady)
    split = {key: sum(r.get(key, 0.0) for r in steady) / len(steady) for key in ("data_s", "head_s", "optimizer_s")}
    return {"tokens_per_s": sum(r["tokens"] for r in steady) / seconds, "step_s": seconds / len(steady), **split}


def train(name: str, work: Path, overrides: list[str], timeout: float) -> tuple[list[dict], dict, float]:
    out = work / name
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mtp_train.train", f"output_dir={out}", *overrides],
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{name}: {(result.stderr or result.stdout).strip().splitlines()[-1]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["split"] == "train"]
    return records, json.loads((out / "summary.json").read_text()), time.monotonic() - start


def row(label: str, m: dict, flops: float, peak: float | None, memory: int | None, extra: str = "") -> str:
    mfu = f"{m['tokens_per_s'] * flops / peak:.1%}" if peak else "n/a"
    gib = f"{memory / 2**30:.1f} GiB" if memory else "n/a"
    return (f"| train | {label} | {m['tokens_per_s']:,.0f} tok/s; step {m['step_s'] * 1e3:.1f} ms = data/target "
            f"{m['data_s'] * 1e3:.1f} + head fwd+bwd {m['head_s'] * 1e3:.1f} + optimizer {m['optimizer_s'] * 1e3:.1f}"
            f"; head MFU {mfu}; peak {gib}{extra} | |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.gpu_train_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stories", type=Path, required=True, help="stories260K's HF folder (its tokenizer)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the figures (default 20)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per stage (default 240)")
    parser.add_argument("--target", type=Path, default=None,
                        help="train for this HF folder instead of the Llama-3.2-1B-shaped one (a smoke run)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the plumbing")
    args = parser.parse_args(argv)
    import torch  # noqa: PLC0415 - after the arguments: --help needs no CUDA
    from transformers import LlamaConfig  # noqa: PLC0415

    from infer.bench.tp_report import LLAMA_3_2_1B, write_random_llama  # noqa: PLC0415

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: mtp_train.gpu_train_check needs a CUDA GPU and torch.cuda.is_available() is False here")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-train-check-"))
    model = args.target or work / "llama-3.2-1b-shaped"
    if args.target is None and not (model / "config.json").is_file():
        write_random_llama(model, LlamaConfig(**LLAMA_3_2_1B))
        for file in TOKENIZER:
            shutil.copy(args.stories / file, model / file)
    if args.device == "cuda":
        os.environ.pop("DS_ACCELERATOR", None)
    common = common_overrides(model, args.steps, args.device, args.target is None)
    dtype = "bfloat16" if args.device == "cuda" else "float32"  # the target's and the features' on both sides
    config = json.loads((model / "config.json").read_text())
    run = {"hidden": config["hidden_size"], "unroll_steps": 4}

    online, online_summary, online_s = train("online", work, [*common, "features=online"], args.timeout)
    run["draft_vocab"] = (online_summary["draft_vocab"] or {}).get("size", config["vocab_size"])
    flops = head_flops_per_token(online_summary, run)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "data_tools.precompute", f"output_dir={work / 'features'}",
                    *[o for o in common if o.startswith(("model", "head=", "data"))], f"precompute.device={args.device}",
                    f"precompute.model_dtype={dtype}", f"precompute.dtype={dtype}", "precompute.overwrite=true",
                    "--no-progress"], check=True, capture_output=True, timeout=args.timeout)
    precompute_s = time.monotonic() - start
    offline, offline_summary, offline_s = train("offline", work, [*common, f"features_dir={work / 'features'}"],
                                                args.timeout)
    m_on, m_off = measure(online, args.warmup), measure(offline, args.warmup)
    shape = "Llama-3.2-1B-shaped bf16" if args.target is None else model.name
    label = f"EAGLE-3 head, {shape} target, {name}, {args.steps} steps x 4 x 512 tokens"
    print(row(f"{label}, online", m_on, flops, peak, online_summary["peak_device_bytes"],
              f"; run {online_s:.0f} s"))
    print(row(f"{label}, precomputed features", m_off, flops, peak, offline_summary["peak_device_bytes"],
              f"; run {offline_s:.0f} s + precompute {precompute_s:.0f} s"))
    print(f"| train | online / precomputed tokens/s | {m_on['tokens_per_s'] / m_off['tokens_per_s']:.2f}x "
          f"(wall with precompute: {(offline_s + precompute_s) / online_s:.2f}x in online's favour) | |")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
