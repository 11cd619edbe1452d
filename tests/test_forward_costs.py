"""What the ideal speedup prices a step's forwards at (infer.bench.forward_costs): timed at the runs' mean context,
in turns as a speculative step runs them (a head's cycle opening with its catch-up), by CUDA events on a GPU; and a
timed run's steps split into forwards and host work (infer.bench.speedup.Timed). The rest of infer.bench.speedup:
tests/test_speedup.py."""

from __future__ import annotations

import time

import pytest
import torch

from infer.bench.forward_costs import ForwardCosts, Stopwatch, forward_costs
from infer.bench.speedup import COST_CONTEXT, Comparison, cost_context, ideal_speedup, timed_generate
from infer.engine import Engine, EngineConfig
from infer.model_runner import ModelRunner
from infer.models.mtp_head import init_head_from_target
from infer.sampling_params import SamplingParams
from tests.test_speedup import spin


def test_forward_costs_are_priced_at_the_timed_runs_mean_context(stories_model, stories_tokenizer):
    """The ideal's forwards are timed where the runs met them: a prompt and half the new tokens on average (never
    fewer than COST_CONTEXT); a timed run counts its engine steps (the steps a shrinking batch adds show there)."""
    assert cost_context([20, 40], 128) == 30 + 64
    assert cost_context([3], 8) == COST_CONTEXT
    plain = timed_generate(Engine(stories_model, stories_tokenizer, [2], EngineConfig(num_pages=64)), [[1, 403, 407]],
                           SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert plain.steps == 9 and plain.tokens == 9  # the prefill emits the first token, then one decode step each


def test_forward_costs_time_the_models_in_turns_as_a_step_runs_them(stories_model, stories_tokenizer, monkeypatch):
    """The ideal's draft and verify forwards are timed as a speculative step runs them, K drafts then the verify:
    a forward that follows the other model's pays what the turn costs (here 30 ms of spinning standing for the
    caches the other model took; a sleep would let the core idle and slow what follows), which each model's forwards back to back (`alone`, the broken control: the ideal
    before) never see. Per cycle the verify pays one turn and the K=3 drafts share one."""
    config = EngineConfig(num_draft_tokens=3, backend="torch", page_size=8, num_pages=64, decode_run_steps=4)
    spec = Engine(stories_model, stories_tokenizer, [2], config)
    spec.attach_drafter("draft", stories_model)
    forward, last = ModelRunner.forward, []
    turn = 0.030

    def forward_in_turns(self, *args, **kwargs):
        if last and last[-1] is not self:
            spin(turn)
        last.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", forward_in_turns)
    costs = forward_costs(spec, 2, context=16, repeats=3, alone=True)
    assert costs.verify >= costs.verify_alone + 0.8 * turn
    assert costs.draft >= costs.draft_alone + 0.8 * turn / 3
    assert costs.verify_alone < turn and costs.draft_alone < turn / 3  # the control: no turn is ever paid
    assert costs.alone() == ForwardCosts(costs.decode, costs.draft_alone, costs.verify_alone)
    assert forward_costs(spec, 2, context=16, repeats=1).draft_alone is None  # timed in turns only
    with pytest.raises(ValueError, match="in turns only"):
        ForwardCosts(1.0, 1.0, 1.0).alone()
    assert ForwardCosts.fastest([costs, ForwardCosts(1.0, 1.0, 1.0)]).verify_alone is None


def test_a_heads_forward_costs_open_each_cycle_with_its_catch_up(stories_model, stories_tokenizer, monkeypatch):
    """A head's step drafts K tokens with K forwards: the catch-up over the K+1 verify rows of each sequence, whose
    output at one row each is the first draft, then K-1 drafts. The ideal prices that forward at its own cost: the
    cycles timed run exactly that pattern, and t(drafting K) = t(catch-up) + (K-1) t(draft); a draft LM's cycle (the
    control) has no catch-up and K drafts. Each cycle's drafts are the steps of a fresh decode run, as a step's
    drafts are (one step's metadata, which no draft reads, would skip the run's plan)."""
    config = EngineConfig(num_draft_tokens=3, backend="torch", page_size=8, num_pages=64, decode_run_steps=2)
    forward, calls, draft_steps = ModelRunner.forward, [], []

    def timed_forwards(kind: str, drafter: torch.nn.Module) -> ForwardCosts:
        engine = Engine(stories_model, stories_tokenizer, [2], config)
        engine.attach_drafter(kind, drafter)

        def logged(self, input_ids, meta, *args, **kwargs):
            calls.append(("target" if self is engine.runner else "drafter", input_ids.shape[0],
                          meta.output_rows is not None and meta.max_q_len > 1))
            if self is not engine.runner and meta.max_q_len == 1:
                draft_steps.append((meta.decode_run, meta.decode_step))
            return forward(self, input_ids, meta, *args, **kwargs)

        calls.clear()
        draft_steps.clear()
        monkeypatch.setattr(ModelRunner, "forward", logged)
        return forward_costs(engine, 2, context=16, repeats=1)

    catch_up, draft, verify = ("drafter", 2 * 4, True), ("drafter", 2, False), ("target", 2 * 4, False)
    decode_run = [("target", 2, False)] * 2
    costs = timed_forwards("mtp", init_head_from_target(stories_model, "stories260K"))
    assert calls == 2 * (decode_run + 2 * [catch_up, draft, draft, verify])  # a warm-up round, then one timed
    runs = [run for run, _ in draft_steps]
    assert [step for _, step in draft_steps] == [0, 1] * 4 and None not in runs  # a run's steps 0 and 1 per cycle
    assert all(runs[i] is runs[i + 1] for i in range(0, 8, 2)) and len({id(run) for run in runs}) == 4
    assert costs.catch_up > 0 and costs.drafting(3) == pytest.approx(costs.catch_up + 2 * costs.draft)
    assert ideal_speedup(2.0, costs, 3) == pytest.approx(2.0 * costs.decode / (costs.drafting(3) + costs.verify))
    assert ForwardCosts(1.0, 0.1, 1.0, catch_up=0.3).drafting(1) == pytest.approx(0.3)

    lm_costs = timed_forwards("draft", stories_model)
    assert calls == 2 * (decode_run + 2 * [draft, draft, draft, verify]) and lm_costs.catch_up is None
    assert [step for _, step in draft_steps] == [0, 1, 2] * 4 and len({id(run) for run, _ in draft_steps}) == 4
    assert lm_costs.drafting(3) == pytest.approx(3 * lm_costs.draft)


def test_forward_costs_on_a_gpu_time_the_kernels_not_the_launches(monkeypatch):
    """On a GPU a forward returns at launch: its cost is read from CUDA events around the launches once the queue
    has run them (one synchronize a burst, none per forward). Here a fake device queue runs 0.5 s of kernels per
    forward while the launch returns at once; the host clock (the CPU stopwatch, the broken control) sees only the
    launches."""
    device_time, syncs = [0.0], []

    class QueuedEvent:  # records where the device queue stands; elapsed_time in ms, as torch.cuda.Event
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            self.at = device_time[0]

        def elapsed_time(self, end: "QueuedEvent") -> float:
            assert syncs, "read before the queue ran"
            return (end.at - self.at) * 1e3

    def launch() -> None:  # 0.5 s of kernels queued, nothing waited for
        device_time[0] += 0.5

    monkeypatch.setattr(torch.cuda, "Event", QueuedEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: syncs.append(args))
    gpu = Stopwatch(torch.device("cuda"))
    for _ in range(3):
        gpu.measure(launch)
    assert gpu.total() == pytest.approx(1.5) and len(syncs) == 1
    assert gpu.total() == 0.0  # the watch starts afresh
    cpu = Stopwatch(torch.device("cpu"))
    cpu.measure(launch)
    assert cpu.total() < 0.05  # the control: the host clock times the launch alone


def test_a_timed_run_splits_its_steps_into_forwards_and_host_work(stories_model, stories_tokenizer, monkeypatch):
    """Timed.forward_s is the time in both models' forwards, the rest of the run is host work: with every forward
    slowed by a known sleep (the drafter's 40 ms, far above the target's whole compute even on a slow machine), the
    forwards hold all the sleeps, and the target's forwards alone (the broken control) miss the drafter's: they fall
    short of the forwards' time by at least the drafter's sleeps (whatever the load: a loaded machine's target
    compute may outgrow every sleep)."""
    config = EngineConfig(num_draft_tokens=2, backend="torch", page_size=8, num_pages=64)
    spec = Engine(stories_model, stories_tokenizer, [2], config)
    spec.attach_drafter("draft", stories_model)
    slept = {spec.runner: 0.0, spec.drafter.runner: 0.0}
    forward = ModelRunner.forward

    def slow_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        pause = 0.040 if self is spec.drafter.runner else 0.001
        time.sleep(pause)
        slept[self] += pause
        return out

    monkeypatch.setattr(ModelRunner, "forward", slow_forward)
    target_before = spec.runner.forward_s
    run = timed_generate(spec, [[1, 403, 407], [1, 500]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    target_only = spec.runner.forward_s - target_before
    drafter_slept = slept[spec.drafter.runner]
    assert drafter_slept >= 0.2 and slept[spec.runner] > 0
    assert sum(slept.values()) <= run.forward_s < run.seconds
    assert target_only + drafter_slept <= run.forward_s  # the control misses the drafter's forwards
    assert run.host_ms_per_step == pytest.approx(1e3 * (run.seconds - run.forward_s) / run.steps)
    assert run.forward_ms_per_step + run.host_ms_per_step == pytest.approx(1e3 * run.seconds / run.steps)
    split = Comparison(run, run, {}, [(run, run)]).step_split()
    assert split["spec_host_ms"] == round(run.host_ms_per_step, 3) and split["spec_forward_ms"] > split["spec_host_ms"]
    assert set(Comparison(run, run, {}, [(run, run)], on_cpu=False).step_split().values()) == {None}  # a GPU's launches
