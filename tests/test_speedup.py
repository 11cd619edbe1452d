"""infer.bench.speedup: tau from conditional acceptance, and the recommended K (an exact identity and hand-worked
cases). The forwards' costs and a timed run's split into forwards and host work: tests/test_forward_costs.py."""

from __future__ import annotations

import json
import time

import pytest
import torch

from infer.bench.forward_costs import ForwardCosts
from infer.bench.speedup import (
    Comparison, IdealShare, StepOverhead, Timed, compare, ideal_speedup, ideal_speedup_with_tail,
    interleaved_generate, interleaved_stream, live_per_verify_step, predicted_speedup, predicted_tau, recommend_k,
    timed_costs, timed_generate,
)
from infer.engine import Engine, EngineConfig
from infer.models.mtp_head import init_head_from_target, read_head_config
from infer.sampling_params import SamplingParams
from infer.speculative import SpecStats
from mtp_train.export import export_head, main


def spin(seconds: float) -> None:
    """Busy-wait: load that holds the core, as a slow spell of a shared machine does (a sleep would let it idle)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def slow_spell(monkeypatch: pytest.MonkeyPatch, steps: int = 16, seconds: float = 0.005) -> list[Engine]:
    """The machine slow for its next `steps` engine steps, each `seconds` longer: the engines that took them, in
    order."""
    step, slow_steps = Engine.step, []

    def step_in_a_spell(self):
        if len(slow_steps) < steps:
            slow_steps.append(self)
            spin(seconds)
        return step(self)

    monkeypatch.setattr(Engine, "step", step_in_a_spell)
    return slow_steps


def test_tau_is_one_plus_the_compounded_conditional_acceptance():
    """On any accepted-length histogram, tau measured = 1 + sum_j prod_{i<=j} a_i with a_i conditional: the
    prediction of smaller K from a run at K=4 rests on this."""
    stats = SpecStats(4)
    for accepted, times in ((0, 7), (1, 5), (2, 3), (3, 2), (4, 9)):
        for _ in range(times):
            stats.record(accepted)
    rates, errors = stats.conditional_acceptance()
    assert rates[0] == pytest.approx(19 / 26) and rates[3] == pytest.approx(9 / 11)
    assert errors[0] == pytest.approx(((19 / 26) * (7 / 26) / 26) ** 0.5)
    assert predicted_tau(rates, 4) == pytest.approx(stats.tau)
    # the unconditional shares compound already: summing them is tau too, and differs from the conditional rates
    assert 1 + sum(stats.to_dict()["acceptance_per_position"]) == pytest.approx(stats.tau, abs=1e-3)
    assert stats.to_dict()["conditional_acceptance"][1] != stats.to_dict()["acceptance_per_position"][1]


def test_recommend_k_maximises_the_predicted_speedup():
    conditional = [0.9, 0.5, 0.1, 0.1]
    costs = {k: ForwardCosts(decode=1.0, draft=0.1, verify=1.0 + 0.05 * k) for k in range(1, 5)}
    rec = recommend_k(conditional, costs)
    by_hand = {1: 1.9 / 1.15, 2: 2.35 / 1.3, 3: 2.395 / 1.45, 4: 2.3995 / 1.6}
    assert rec.predicted_speedup == pytest.approx(by_hand)
    assert rec.k == 2
    # a free verify forward and perfect drafts: the longest chain wins
    assert recommend_k([1.0] * 4, {k: ForwardCosts(1.0, 0.0, 1.0) for k in range(1, 5)}).k == 4
    assert ideal_speedup(predicted_tau([1.0] * 4, 4), ForwardCosts(1.0, 0.0, 1.0), 4) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="covered by acceptance measured at 1 positions"):
        recommend_k([0.5], {2: costs[2]})
    # drafts that cost as much as the target and rarely land: every K loses to plain decoding, which is recommended
    dear = {k: ForwardCosts(decode=1.0, draft=1.0, verify=1.2) for k in range(1, 5)}
    lose = recommend_k([0.3, 0.3, 0.3, 0.3], dear)
    assert max(lose.predicted_speedup.values()) < 1 and lose.k == 0 and lose.best_k == 1
    assert lose.to_dict()["k"] == 0


def test_ideal_share_prices_each_repeat_by_its_own_forward_costs():
    """The machine drifts: a repeat run 1.5x slower has 1.5x slower runs and forwards. Each repeat keeps 0.8 of its
    ideal, and so does their median; mixing the fastest runs with the fastest costs of another spell does not."""
    tau, k = 3.0, 4
    base = ForwardCosts(decode=1.0, draft=0.2, verify=1.4)  # ideal = 3 * 1 / 2.2
    pairs, costs = [], []
    for slow in (1.0, 1.5, 1.2):
        c = ForwardCosts(base.decode * slow, base.draft * slow, base.verify * slow)
        spec_tok_s = 100 * 0.8 * ideal_speedup(tau, c, k)
        pairs.append((Timed(100 * slow, 100 * 100, [], 100), Timed(100 * slow * 100 / spec_tok_s, 100 * 100, [], 34)))
        costs.append(c)
    # a spell that slowed the forwards alone after the second repeat: the fastest costs are the slow spell's
    costs[2] = ForwardCosts(base.decode * 0.7, base.draft * 1.2, base.verify * 1.2)
    result = Comparison(min((p for p, _ in pairs), key=lambda r: r.seconds),
                        min((s for _, s in pairs), key=lambda r: r.seconds), {"tau": tau}, pairs)
    share = IdealShare.of(result, costs, k)
    assert share.achieved_over_ideal == pytest.approx(0.8)
    assert share.speedup == pytest.approx(0.8 * ideal_speedup(tau, base, k))
    fastest_runs = result.spec.tok_s / result.plain.tok_s
    mixed = fastest_runs / ideal_speedup(tau, ForwardCosts.fastest(costs), k)  # the broken control
    assert abs(mixed - 0.8) > 0.1
    assert ForwardCosts.fastest(costs) == ForwardCosts(0.7, 0.2, 1.4)
    with pytest.raises(ValueError, match="2 forward-cost measurements for 3 repeats"):
        IdealShare.of(result, costs[:2], k)


def test_the_ideal_with_tail_prices_each_verify_step_at_the_batch_it_still_held():
    """Requests that verified 3, 2 and 1 times leave 3, 2, 1 speculating: each step is priced at its own batch, the
    costs linear between batch 1 and the full batch. The mean-tau ideal (the broken control for such a batch) prices
    every step at the full batch and misses the tail's steps; a batch whose requests all take the same steps gets
    it exactly."""
    from types import SimpleNamespace  # noqa: PLC0415

    def batch(*verify_steps: int) -> list:
        return [SimpleNamespace(spec_stats=SpecStats(2, verify_steps=n)) for n in verify_steps]

    assert live_per_verify_step(batch(1, 3, 2)) == [3, 2, 1] and live_per_verify_step([]) == []
    full, single, k = ForwardCosts(decode=1.0, draft=0.5, verify=2.0), ForwardCosts(0.6, 0.3, 1.0), 2
    step = {3: 2 * 0.5 + 2.0, 2: 2 * 0.4 + 1.5, 1: 2 * 0.3 + 1.0}  # batch 2: halfway between 1 and 3
    live = live_per_verify_step(batch(3, 2, 1))
    assert ideal_speedup_with_tail(live, 8, full, single, k) == pytest.approx(8 * 1.0 / sum(step.values()))
    tau = 3 * 8 / 6  # 8 tokens each over 6 verify steps
    assert ideal_speedup(tau, full, k) > 1.1 * ideal_speedup_with_tail(live, 8, full, single, k)
    flat = live_per_verify_step(batch(4, 4, 4))
    assert ideal_speedup_with_tail(flat, 8, full, single, k) == pytest.approx(ideal_speedup(8 / 4, full, k))


def test_a_request_counts_its_own_verify_steps(stories_model, stories_tokenizer):
    """The per-request counts the tail is read from: with the target as its own drafter (greedy acceptance 1.0)
    every request verifies in the same steps, the batch never shrinks, and the counts sum to the engine's."""
    config = EngineConfig(num_draft_tokens=2, backend="torch", page_size=8, num_pages=32)
    spec = Engine(stories_model, stories_tokenizer, [2], config)
    spec.attach_drafter("draft", stories_model)
    prompts = [stories_tokenizer.encode("Once upon a time"), stories_tokenizer.encode("Lily had a dog")]
    run = timed_generate(spec, prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert live_per_verify_step(run.requests) == [2, 2, 2]  # 9 tokens after the prefill's, 3 a step
    assert sum(r.spec_stats.verify_steps for r in run.requests) == spec.spec_stats.verify_steps == 6


def test_bench_refuses_speculation_with_no_token_to_speculate_on(stories_hf_dir, tmp_path, capsys):
    """One new token is the prefill's: there is no verify step to time, so --spec asks for two (one line, exit 2)
    instead of dividing by a zero ideal."""
    from infer.bench.cli import main as bench_main  # noqa: PLC0415
    from infer.cli import run_cli  # noqa: PLC0415

    argv = ["--model", str(stories_hf_dir), "--spec", "mtp", "--draft", str(tmp_path), "--max-new-tokens", "1"]
    assert run_cli(lambda: bench_main(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-new-tokens >= 2" in err and "got 1" in err


def test_export_carries_the_reports_recommendation_and_generate_uses_it(tmp_path, stories_model):
    from infer.models.mtp_head import init_head_from_target, save_head  # noqa: PLC0415

    head = save_head(init_head_from_target(stories_model, "stories260K"), tmp_path / "head")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"recommended_k": {"by_batch_size": {"1": {"k": 3}, "8": {"k": 2}, "32": {"k": 1}}}}))
    out = export_head(head, "runtime", tmp_path / "runtime", report=report)
    config = read_head_config(out)
    assert config.recommended_k == {"1": 3, "8": 2, "32": 1}
    assert [config.num_draft_tokens_for(b) for b in (1, 4, 8, 31, 32, 64)] == [3, 3, 2, 2, 1, 1]
    assert read_head_config(head).recommended_k == {}  # the source head is left as it was
    from tests.test_export import eagle_head  # noqa: PLC0415 - a head the eagle format takes

    servable = save_head(eagle_head(stories_model, perturbed=False), tmp_path / "eagle_head")
    eagle = json.loads((export_head(servable, "eagle", tmp_path / "eagle", report=report) / "config.json").read_text())
    assert eagle["mtp_head"]["recommended_k"] == {"1": 3, "8": 2, "32": 1}
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    from infer.cli import run_cli  # noqa: PLC0415

    assert run_cli(lambda: main(["--head", str(head), "--format", "eagle", "--out", str(tmp_path / "x"),
                                 "--report", str(bad)])) == 2


def test_generate_decodes_plainly_where_the_head_recommends_k_0(tmp_path, stories_model, stories_hf_dir, capsys):
    """A recommended K of 0 (the validation predicted plain decoding faster at that batch size) attaches no drafter
    and says so; --num-draft-tokens speculates anyway; at a batch size whose recommendation is 3 the head drafts 3."""
    from infer.cli import attach_spec  # noqa: PLC0415
    from infer.generate import build_parser  # noqa: PLC0415
    from infer.models.mtp_head import save_head  # noqa: PLC0415

    head = save_head(init_head_from_target(stories_model, "stories260K"), tmp_path / "head")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"recommended_k": {"by_batch_size": {"1": {"k": 3}, "8": {"k": 0}}}}))
    out = export_head(head, "runtime", tmp_path / "runtime", report=report)

    def attached(batch_size: int, *flags: str) -> Engine:
        args = build_parser().parse_args(["--model", str(stories_hf_dir), "--spec", "mtp", "--draft", str(out),
                                          "--prompt", "x", *flags])
        engine = Engine.from_pretrained(stories_hf_dir, dtype=torch.float32, device="cpu", max_num_seqs=8)
        attach_spec(engine, args, batch_size)
        return engine

    assert attached(1).drafter is not None and attached(1).num_draft_tokens == 3
    capsys.readouterr()
    assert attached(8).drafter is None
    err = capsys.readouterr().err
    assert "no K beats plain decoding at batch 8" in err and str(out) in err
    forced = attached(8, "--num-draft-tokens", "2")
    assert forced.drafter is not None and forced.num_draft_tokens == 2


def test_step_overhead_is_fitted_through_two_ks_and_predicts_the_ones_between():
    """Synthetic runs whose step overhead is 0.3 + 0.1 K ms (plain: 0.2 ms): the fit recovers it from K=1 and K=4,
    and the prediction at K=2 and 3 is exact; a single K gives a flat overhead."""
    batch, tau = 8, {1: 1.8, 2: 2.2, 3: 2.5, 4: 2.7}
    costs = {k: ForwardCosts(decode=0.5e-3, draft=0.2e-3, verify=(0.6 + 0.05 * k) * 1e-3, catch_up=0.25e-3)
             for k in tau}
    plain_tok_s = batch / (0.5e-3 + 0.2e-3)
    # a head's step: its catch-up, K-1 drafts, the verify and the overhead
    spec_tok_s = {k: batch * tau[k] / (0.25e-3 + (k - 1) * 0.2e-3 + costs[k].verify + (0.3 + 0.1 * k) * 1e-3)
                  for k in tau}
    fitted = StepOverhead.fitted({k: (plain_tok_s, spec_tok_s[k], tau[k]) for k in (1, 4)}, costs, batch)
    assert (fitted.plain, fitted.spec, fitted.spec_per_draft) == pytest.approx((0.2e-3, 0.3e-3, 0.1e-3))
    for k in (2, 3):
        assert predicted_speedup(tau[k], costs[k], k, fitted) == pytest.approx(spec_tok_s[k] / plain_tok_s)
    flat = StepOverhead.fitted({4: (plain_tok_s, spec_tok_s[4], tau[4])}, costs, batch)
    assert flat.spec_per_draft == 0 and flat.spec_at(1) == pytest.approx(0.7e-3)


def test_bench_recommendation_is_the_sweeps_best_k_on_runs_the_model_describes():
    """infer.bench's recommendation from rows whose tokens/s follow the cost model exactly (step overhead 0.3 + 0.1 K
    ms, acceptance 0.9, 0.7, 0.5, 0.3: K=2 is best): it recommends the measured best K and predicts every K's
    tokens/s exactly; a row whose speculative tokens/s is 20% off (K=3, not one of the two fitted) is the worst
    error."""
    from infer.bench.cli import recommendations  # noqa: PLC0415

    batch, conditional = 8, [0.9, 0.7, 0.5, 0.3]
    rows = []
    for k in (1, 2, 3, 4):
        cost = ForwardCosts(decode=0.5e-3, draft=0.2e-3, verify=(0.6 + 0.05 * k) * 1e-3, catch_up=0.25e-3)
        tau = predicted_tau(conditional, k)
        rows.append({"temperature": 0.0, "batch_size": batch, "k": k, "tau": tau,
                     "plain_tok_s": batch / (cost.decode + 0.2e-3),
                     "spec_tok_s": batch * tau / (0.25e-3 + (k - 1) * cost.draft + cost.verify
                                                  + (0.3 + 0.1 * k) * 1e-3),
                     "conditional_acceptance": conditional[:k],
                     **{f"t_{name}_ms": ms for name, ms in cost.milliseconds().items()}})
    (exact,) = recommendations(rows)
    assert exact["recommended_k"] == exact["measured_best_k"] == 2
    assert exact["predicted_over_measured"] == 1.0 and exact["worst_error_any_k"] == 0.0
    rows[2]["spec_tok_s"] *= 1.25  # K=3 measured 25% faster: predicted / measured - 1 = -0.2
    (off,) = recommendations(rows)
    assert off["worst_error_any_k"] == pytest.approx(-0.2, abs=1e-3) and off["measured_best_k"] == 3
    # a plain run beside K=3 twice as fast (the machine drifted): each K is judged against its own plain run
    rows[2]["plain_tok_s"] *= 2
    assert recommendations(rows)[0]["measured_best_k"] == 2
    # every K measured and predicted below plain decoding: both say 0, the prediction still checked at its best K
    for row in rows:
        row["plain_tok_s"] = 2 * row["spec_tok_s"]
    (slow,) = recommendations(rows)
    assert slow["recommended_k"] == slow["measured_best_k"] == 0 and slow["checked_k"] == 2 and slow["predicted_over_measured"] > 1


def test_compare_counts_one_timed_runs_statistics(stories_model, stories_tokenizer):
    """The timed repeats replay the same seeded requests: the acceptance statistics (and so their standard errors)
    are one run's, whatever the number of repeats."""
    config = EngineConfig(num_draft_tokens=2, backend="torch", page_size=8, num_pages=32)
    plain, spec = (Engine(stories_model, stories_tokenizer, [2], config) for _ in range(2))
    spec.attach_drafter("draft", stories_model)
    prompts = [stories_tokenizer.encode("Once upon a time"), stories_tokenizer.encode("Lily had a dog")]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=3)
    once, thrice = compare(plain, spec, prompts, params, 1).stats, compare(plain, spec, prompts, params, 3).stats
    measured, between = timed_costs(spec, len(prompts), params.max_new_tokens, repeats=1)
    result = compare(plain, spec, prompts, params, 2, between)
    assert len(result.pairs) == len(measured) == 2 and all(c.verify > 0 for c in measured)
    assert once["verify_steps"] > 0
    assert thrice["verify_steps"] == once["verify_steps"]
    assert thrice["conditional_acceptance_se"] == once["conditional_acceptance_se"]


def test_interleaved_runs_share_a_spell_of_load_that_runs_one_after_the_other_do_not(stories_model,
                                                                                     stories_tokenizer, monkeypatch):
    """Two identical engines (true ratio 1) on a machine slow for its first 16 steps (each spins 5 ms more):
    interleaved by step, both runs meet the spell and their ratio stays near 1; run one after the other (the broken
    control), the first run takes all of it. Each engine's outputs are those of its own run."""
    config = EngineConfig(backend="torch", page_size=8, num_pages=32)
    first, second = (Engine(stories_model, stories_tokenizer, [2], config) for _ in range(2))
    prompts = [stories_tokenizer.encode("Once upon a time"), stories_tokenizer.encode("Lily had a dog")]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    slow_steps = slow_spell(monkeypatch)
    a, b = interleaved_generate((first, second), prompts, params)
    assert a.tokens == b.tokens == 48 and a.steps == b.steps == 24
    assert [r.output_ids for r in a.requests] == [r.output_ids for r in b.requests]
    assert slow_steps.count(first) == slow_steps.count(second) == 8
    assert 0.8 < a.seconds / b.seconds < 1.25
    slow_steps.clear()
    one, other = timed_generate(first, prompts, params), timed_generate(second, prompts, params)
    assert slow_steps.count(first) == 16
    assert one.seconds / other.seconds > 1.4


def test_a_stream_of_arrivals_is_interleaved_and_timed_on_each_engines_own_clock(stories_model, stories_tokenizer,
                                                                                monkeypatch):
    """infer.bench --arrivals: two identical engines (true latency ratio 1) take a stream of 4 requests, one every 3
    steps of the first, on a machine slow for its first 16 steps: interleaved by their own clocks, each meets about
    half of the spell and the latency ratio stays near 1, with the same tokens. Then the second engine spins 50 ms a step:
    its seconds never count on the first's clock."""
    config = EngineConfig(backend="torch", page_size=8, num_pages=64)
    prompts = [stories_tokenizer.encode("Once upon a time"), stories_tokenizer.encode("Lily had a dog")]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    step, add_request, added = Engine.step, Engine.add_request, []
    slow_steps = slow_spell(monkeypatch)
    first, second = (Engine(stories_model, stories_tokenizer, [2], config) for _ in range(2))
    a, b = interleaved_stream(first, second, prompts, params, count=4, every=3)
    assert a.tokens == b.tokens == 64 and len(a.requests) == len(b.requests) == 4
    assert [r.output_ids for r in a.requests] == [r.output_ids for r in b.requests]
    assert 6 <= slow_steps.count(first) <= 10  # by clock, not turn by turn: about half (one after the other: 16)
    assert 0.8 < a.latency_s / b.latency_s < 1.25 and 0.8 < a.seconds / b.seconds < 1.25

    def slow_second(self):
        if self is slow:
            spin(0.050)
        return step(self)

    def logged_add(self, *args, **kwargs):
        added.append(self)
        return add_request(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "step", slow_second)
    monkeypatch.setattr(Engine, "add_request", logged_add)
    fast, slow = (Engine(stories_model, stories_tokenizer, [2], config) for _ in range(2))
    a, b = interleaved_stream(fast, slow, prompts, params, count=4, every=3)
    assert a.seconds < 0.25 * b.seconds and a.latency_s < 0.25 * b.latency_s  # 50 ms a step: the second's alone
    assert b.seconds >= 0.050 * 16  # at least its own steps for the last request's 16 tokens
    assert added.count(fast) == added.count(slow) == 4


def test_the_runtime_steps_alongside_transformers_generate_one_step_each(stories_hf_dir, stories_model,
                                                                        stories_tokenizer, monkeypatch):
    """infer.bench's baseline: each of transformers' steps is followed by one of the engine's, the same greedy
    tokens come out of both, and the seconds of the engine's steps are not counted as transformers'."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - the baseline only

    from infer.bench.cli import run_alongside_transformers  # noqa: PLC0415

    hf = AutoModelForCausalLM.from_pretrained(stories_hf_dir).eval()
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", page_size=8, num_pages=32))
    events, step, forward = [], Engine.step, hf.forward

    def engine_step(self):
        events.append("ours")
        spin(0.030)  # 30 ms a step: far more than transformers' stories260K step
        return step(self)

    def hf_forward(*args, **kwargs):
        events.append("transformers")
        return forward(*args, **kwargs)

    monkeypatch.setattr(Engine, "step", engine_step)
    monkeypatch.setattr(hf, "forward", hf_forward)
    (ours_s, ours_tokens), (hf_s, hf_tokens) = run_alongside_transformers(
        engine, hf, stories_tokenizer, ["Once upon a time"], 12)
    assert events == ["transformers", "ours"] * 12
    assert ours_tokens == hf_tokens == 12
    assert ours_s > 12 * 0.030 > hf_s  # generate's own seconds, the engine's steps within it taken out
    generated = engine.generate([stories_tokenizer.encode("Once upon a time")],
                                SamplingParams(max_new_tokens=12, ignore_eos=True))[0].output_ids
    batch = stories_tokenizer(["Once upon a time"], return_tensors="pt")
    reference = hf.generate(**batch, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert generated == reference[0, batch["input_ids"].shape[1]:].tolist()
