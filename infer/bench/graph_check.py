"""The GPU check's rows for CUDA graphs (`infer.bench.gpu_check --checks graphs,spec-graphs`, issue #46).

  graphs       decode tokens/s at batch 1, 8 and 32 on Llama-3.2-1B- and Llama-3.1-8B-shaped bf16 random models,
               CUDA graphs on and off, each as a share of the bandwidth limit (every weight read once a step: weight
               bytes over the device-to-device copy bandwidth measured in the same run); then, at batch 1, kernels
               and GPU-busy ms a step (torch.profiler), host ms a step, and host syncs a step
               (torch.cuda.set_sync_debug_mode); at batch 1 and 8, graphs with overlapped decoding too
               (`EngineConfig.overlap`: the next step launched before the host reads this one's tokens).
  spec-graphs  speculation at a known acceptance through graphs: an EAGLE-3 head with a 32k draft vocabulary runs its
               real forwards but proposes the target's own greedy tokens (`infer.bench.oracle_drafter`), each right
               with probability 0.8 given the ones before; K=2 and 4, batch 1 and 8, on the 1B shape. ratio =
               speedup over plain decoding with graphs; ideal = the measured tau (every step as cheap as a plain one).

The models are built on the device with random weights (no checkpoint on disk: the 8B shape's 16 GB would take
minutes to write and read).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import LlamaConfig

from infer.bench.cli import best_of, run_engine
from infer.bench.oracle_drafter import attach_oracle
from infer.bench.speedup import timed_generate
from infer.bench.tp_report import LLAMA_3_2_1B
from infer.engine import Engine, EngineConfig
from infer.loader import build_on_meta, serve_lean
from infer.models.eagle3_head import init_eagle3_from_target
from infer.models.llama import LlamaForCausalLM
from infer.models.mtp_head import head_config_for, head_module, shared_weights, target_digest, target_identity
from infer.parallel import current, one_line
from infer.sampling_params import SamplingParams

LLAMA_3_1_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)
SHAPES = {"llama-3.2-1b-shaped": LLAMA_3_2_1B, "llama-3.1-8b-shaped": LLAMA_3_1_8B}
DRAFT_VOCAB = 32000  # the peers' EAGLE-3 default
PROMPT_LEN = 16


def random_model(shape: dict, device: str, dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """An infer Llama of this shape with N(0, 0.02) weights (norms at 1), each made on the device (built on the
    meta device first: no host copy of the weights)."""
    torch.manual_seed(0)
    config = LlamaConfig(**shape)
    model = build_on_meta(config, current())
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            weight = torch.empty(param.shape, dtype=dtype, device=device)
            weight.fill_(1.0) if name == "weight" and prefix.endswith("norm") else weight.normal_(0.0, 0.02)
            setattr(module, name, torch.nn.Parameter(weight, requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return serve_lean(model.to(device).eval())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads (a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s a device-to-device copy moves (read + write), the best of `repeats`."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def step_costs(engine: Engine, batch: int, steps: int = 32) -> dict[str, float]:
    """Per decode step of a running batch: kernels and GPU-busy ms (torch.profiler), host ms (the step's wall time:
    on a host-bound step, the host's), host syncs (set_sync_debug_mode's warnings). On a CPU (tests): aten ops for
    kernels, their CPU ms, and no sync count."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 - the check only

    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = SamplingParams(max_new_tokens=3 * steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([1 + i for i in range(PROMPT_LEN)], params)
    for _ in range(4):  # prefill and warm-up
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    host_ms = (time.perf_counter() - start) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.device_time for e in kernels) / 1e3 / steps
    else:
        kernels = [e for e in prof.events() if e.name.startswith("aten::")]
        busy_ms = sum(e.self_cpu_time_total for e in kernels) / 1e3 / steps
    syncs = 0.0
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught) / steps
    while engine.has_unfinished():
        engine.step()
    return {"kernels": len(kernels) / steps, "gpu_ms": busy_ms, "host_ms": host_ms, "syncs": syncs}


def same_tokens(ours: list[list[int]], reference: list[list[int]]) -> str:
    """How many requests generated the reference's tokens, and where the others first differ (bf16 near-ties in a
    random model's logits may flip an argmax: a graph replays another attention kernel than the eager FlashInfer)."""
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, reference)]
    differ = [i for i in firsts if i is not None]
    return f"equal {len(firsts) - len(differ)}/{len(firsts)}" + (f", first differ at {min(differ)}" if differ else "")


def step_cost_row(engine: Engine, name: str, mode: str, steps: int = 32) -> dict:
    """`step_costs` at batch 1 as a row (ratio: the GPU's busy share of a step); a failure becomes its row's error,
    the decode rows stay."""
    row = {"check": "graphs", "model": name, "setting": f"step costs, batch 1, graphs {mode}", "reference": "",
           "ratio": ""}
    try:
        costs = step_costs(engine, 1, steps)
    except Exception as err:  # noqa: BLE001 - reported in the table
        return {**row, "value": f"error: {one_line(err)[:160]}"}
    layers = engine.model.config.num_hidden_layers
    return {**row, "value": f"{costs['kernels']:.0f} kernels ({costs['kernels'] / layers:.1f} a layer), GPU "
                            f"{costs['gpu_ms']:.2f} ms",
            "reference": f"host {costs['host_ms']:.2f} ms, {costs['syncs']:.1f} syncs",
            "ratio": f"{costs['gpu_ms'] / costs['host_ms']:.2f}"}


def decode_graph_rows(name: str, device: str, batches: list[int], new_tokens: int, repeats: int,
                      shape: dict | None = None, cost_steps: int = 32, backend: str = "auto",
                      overlap_batches: tuple[int, ...] = (1, 8)) -> list[dict]:
    """Decode tok/s, graphs on and off, as shares of the bandwidth limit; step costs at batch 1; at overlap_batches,
    graphs with overlap against graphs alone. On a CPU (tests: a tiny `shape`) graphs are the padded path. backend
    "auto": FlashInfer (and its graph wrappers) where it imports."""
    model = random_model(shape or SHAPES[name], device)
    limit_steps = copy_bandwidth(device, 1 << 30 if device == "cuda" else 1 << 24) / weight_bytes(model)  # steps/s
    graphs = "on" if device == "cuda" else "padded"
    prompts = torch.randint(3, model.config.vocab_size, (max(batches), PROMPT_LEN),
                            generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        speeds, outputs = {}, {}
        modes = ("off", graphs, "overlap") if batch in overlap_batches else ("off", graphs)
        for mode in modes:
            engine = Engine(model, None, [], EngineConfig(max_num_seqs=batch, num_pages=batch * 16 + 8,
                                                          cuda_graphs=graphs if mode == "overlap" else mode,
                                                          backend=backend, overlap=mode == "overlap"))
            if mode == graphs:
                attention = engine.runner.graphs.attention
            run_engine(engine, prompts[:batch], SamplingParams(max_new_tokens=8, ignore_eos=True))  # capture

            def timed() -> tuple[float, int]:
                run = timed_generate(engine, prompts[:batch], params)
                outputs[mode] = [r.output_ids for r in run.requests]  # noqa: B023 - read before the next mode
                return run.seconds, run.tokens

            seconds, tokens = best_of(repeats, timed)
            speeds[mode] = tokens / seconds
            if batch == 1 and mode != "overlap":
                rows.append(step_cost_row(engine, name, mode, cost_steps))
        limit = batch * limit_steps
        rows.append({"check": "graphs", "model": name, "setting": f"decode batch {batch}, bandwidth limit "
                                                                  f"{limit:.0f} tok/s",
                     "value": f"graphs {speeds[graphs]:.1f} tok/s ({speeds[graphs] / limit:.1%})",
                     "reference": f"eager {speeds['off']:.1f} tok/s ({speeds['off'] / limit:.1%}); greedy tokens "
                                  f"{same_tokens(outputs[graphs], outputs['off'])}; graphs attend by {attention}",
                     "ratio": f"{speeds[graphs] / speeds['off']:.2f}"})
        if "overlap" in speeds:
            rows.append({"check": "graphs", "model": name, "setting": f"decode batch {batch}, graphs + overlap",
                         "value": f"{speeds['overlap']:.1f} tok/s ({speeds['overlap'] / limit:.1%})",
                         "reference": f"graphs alone {speeds[graphs]:.1f} tok/s; greedy tokens "
                                      f"{same_tokens(outputs['overlap'], outputs[graphs])}",
                         "ratio": f"{speeds['overlap'] / speeds[graphs]:.2f}"})
    del model
    return rows


def eagle3_head_for(model: LlamaForCausalLM, name: str, draft_vocab: int = DRAFT_VOCAB):
    """An untrained EAGLE-3 head on `model` with a draft vocabulary of its first `draft_vocab` ids."""
    param = next(model.parameters())
    identity = target_identity(name, model.config, target_digest(model))
    config = head_config_for(model.config, identity, "eagle3", draft_vocab_size=draft_vocab)
    head = head_module(config).to(device=param.device, dtype=param.dtype).attach(shared_weights(model))
    init_eagle3_from_target(head, model)
    head.set_draft_vocab(torch.arange(draft_vocab))
    return serve_lean(head.eval().requires_grad_(False))


def oracle_speedup(model: LlamaForCausalLM, head, prompts: list[list[int]], k: int, new_tokens: int, repeats: int,
                   cuda_graphs: str, acceptance: float = 0.8, backend: str = "auto") -> dict[str, float | str]:
    """Plain and oracle-drafted tok/s on the same prompts (greedy), the oracle's tau and what attends in its graphs."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    config = EngineConfig(max_num_seqs=len(prompts), num_pages=len(prompts) * 24 + 8, num_draft_tokens=k,
                          cuda_graphs=cuda_graphs, backend=backend)
    plain = Engine(model, None, [], config)
    continuations = {tuple(r.prompt_ids): r.output_ids for r in plain.generate(prompts, params)}
    seconds, tokens = best_of(repeats, lambda: run_engine(plain, prompts, params))
    spec = Engine(model, None, [], config)
    attach_oracle(spec, head, continuations, acceptance)
    run_engine(spec, prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # capture
    spec.reset_spec_stats()
    spec_seconds, spec_tokens = best_of(repeats, lambda: run_engine(spec, prompts, params))
    attention = spec.runner.graphs.attention if spec.runner.graphs is not None else "no graphs"
    return {"plain": tokens / seconds, "spec": spec_tokens / spec_seconds, "tau": spec.spec_stats.tau,
            "attention": attention}


def spec_graph_rows(device: str, new_tokens: int, repeats: int, name: str = "llama-3.2-1b-shaped") -> list[dict]:
    model = random_model(SHAPES[name], device)
    head = eagle3_head_for(model, name)
    rows = []
    for batch in (1, 8):
        prompts = torch.randint(3, model.config.vocab_size, (batch, PROMPT_LEN),
                                generator=torch.Generator().manual_seed(batch)).tolist()
        for k in (2, 4):
            got = oracle_speedup(model, head, prompts, k, new_tokens, repeats, "on")
            speedup = got["spec"] / got["plain"]
            rows.append({"check": "spec-graphs", "model": name,
                         "setting": f"EAGLE-3 (32k draft vocab) oracle 0.8, K={k}, batch {batch}, graphs on",
                         "value": f"{got['spec']:.1f} tok/s, tau {got['tau']:.2f}",
                         "reference": f"plain {got['plain']:.1f} tok/s; achieved/ideal {speedup / got['tau']:.2f}; "
                                      f"graphs attend by {got['attention']}",
                         "ratio": f"{speedup:.2f}"})
    return rows


GRAPH_CHILD_TIMEOUT_S = 330  # the graph rows' share of the GPU check's 10 minutes


def graph_child_command(stories: Path, checks: list[str], new_tokens: int, repeats: int) -> list[str]:
    """The GPU check's graph rows alone (`python -m infer.bench.gpu_check --graphs-child`)."""
    return [sys.executable, "-m", "infer.bench.gpu_check", "--stories", str(stories), "--checks", ",".join(checks),
            "--max-new-tokens", str(new_tokens), "--repeats", str(repeats), "--graphs-child"]


def graph_rows_in_child(command: list[str], check: str, timeout_s: float = GRAPH_CHILD_TIMEOUT_S) -> Iterator[dict]:
    """The rows a process of its own prints ("row at N s: {json}"), as they land; a process that fails or overruns
    (killed at timeout_s) ends in an error row, and the caller's checks go on."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                if line.startswith("row at "):
                    yield json.loads(line.split(": ", 1)[1])
            code = proc.wait()
        finally:
            overran = not watchdog.is_alive() and proc.returncode != 0
            watchdog.cancel()
            proc.kill()
    if overran:
        message = f"the graph checks overran {timeout_s:.0f} s and were stopped"
    elif code != 0:
        message = f"the graph checks' process ended with code {code} (its stderr is above)"
    else:
        return
    yield {"check": check, "model": "", "setting": "", "value": f"error: {message}", "reference": "", "ratio": ""}
