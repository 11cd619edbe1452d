"""Overlapped plain decoding (`infer.engine.overlap`) on stories260K: the same tokens as the engine without it, for
greedy and seeded sampling, endings at different steps, requests joining and aborted mid-run; and the order of a
step: the next step's forward is launched from the device's sampled tokens before the host reads them."""

from __future__ import annotations

import pytest

import infer.engine.loop as loop_module
import infer.engine.overlap as overlap_module
from infer.engine import Engine, EngineConfig
from infer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STORY_END = 1  # stories260K ends a story with BOS


def _engine(model, tokenizer, overlap: bool, **config) -> Engine:
    return Engine(model, tokenizer, [2], EngineConfig(**dict(page_size=4, num_pages=256, backend="torch",
                                                             overlap=overlap, decode_run_steps=4) | config))


def _scenario(engine: Engine) -> list[tuple[list[int], str | None]]:
    """Requests that end by a stop id, a stop string, max_new_tokens and an abort at different steps, greedy and
    seeded, two joining at step 3 and one aborted after step 6; returns each one's tokens and ending."""
    greedy = dict(stop_token_ids=(STORY_END,))
    first = [
        ("Once upon a time", SamplingParams(max_new_tokens=9, **greedy)),  # length
        ([1], SamplingParams(max_new_tokens=40, stop=("Lily",), **greedy)),  # a stop string
        ("Tom", SamplingParams(max_new_tokens=30, temperature=1.0, seed=5, stop_token_ids=(425,))),  # a stop id
        ("Sue had a red ball", SamplingParams(max_new_tokens=30, stop_token_ids=(422,))),  # a stop id
        ("The cat sat", SamplingParams(max_new_tokens=25, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
        ("Mom said", SamplingParams(max_new_tokens=30, **greedy)),  # aborted
    ]
    joining = [
        ("One day, a big dog", SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, **greedy)),
        ("Lily wanted", SamplingParams(max_new_tokens=5, **greedy)),
    ]
    requests = [engine.add_request(p, sp) for p, sp in first]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            requests += [engine.add_request(p, sp) for p, sp in joining]
        if steps == 6:
            engine.abort(requests[5])
    assert engine.pool.num_free == engine.pool.num_pages  # every page came back
    return [(r.output_ids, r.finish_reason) for r in requests]


def test_overlapped_engine_emits_the_tokens_of_the_plain_one(stories_model, stories_tokenizer, monkeypatch):
    plain = _scenario(_engine(stories_model, stories_tokenizer, overlap=False))
    launched = []

    def counting_follow_on(engine, prev):
        step = overlap_module.follow_on(engine, prev)
        launched.append((step is not None, sum(r.finished for r in prev.requests)))
        return step

    monkeypatch.setattr(loop_module, "follow_on", counting_follow_on)
    overlapped = _scenario(_engine(stories_model, stories_tokenizer, overlap=True))
    assert overlapped == plain
    assert {reason for _, reason in plain} == {"length", "stop", "abort"}
    assert plain[1][1] == "stop" and plain[1][0][-1] != STORY_END  # the stop string, not an id
    assert plain[2] == (plain[2][0], "stop") and plain[2][0][-1] == 425 and len(plain[2][0]) < 30  # sampled, a stop id
    assert plain[3] == (plain[3][0], "stop") and plain[3][0][-1] == 422  # greedy, a stop id
    assert len({len(ids) for ids, _ in plain}) >= 6  # the endings fall at different steps
    assert sum(ok for ok, _ in launched) > 20  # the steps did overlap...
    assert any(ok and discarded for ok, discarded in launched)  # ...also past a request whose extra row was dropped

    def misrouted_follow_on(engine, prev):  # the control: the next step's ids in the wrong rows
        prev.sampled = prev.sampled.flip(0)
        return overlap_module.follow_on(engine, prev)

    monkeypatch.setattr(loop_module, "follow_on", misrouted_follow_on)
    assert _scenario(_engine(stories_model, stories_tokenizer, overlap=True)) != plain


def test_a_full_batch_overlaps_while_requests_wait(stories_model, stories_tokenizer, monkeypatch):
    """With every seat taken (max_num_seqs) no waiting request could join, so steps overlap while requests wait; a
    request that stops frees its seat a step later than without overlap, and the tokens are the same; with a free
    seat (the control) no step overlaps while a request waits."""
    waiting_follow_ons = []

    def recording_follow_on(engine, prev):
        step = overlap_module.follow_on(engine, prev)
        waiting_follow_ons.append(step is not None and bool(engine.waiting))
        return step

    monkeypatch.setattr(loop_module, "follow_on", recording_follow_on)
    plain = _scenario(_engine(stories_model, stories_tokenizer, overlap=False, max_num_seqs=3))
    assert _scenario(_engine(stories_model, stories_tokenizer, overlap=True, max_num_seqs=3)) == plain
    assert sum(waiting_follow_ons) > 5
    waiting_follow_ons.clear()
    _scenario(_engine(stories_model, stories_tokenizer, overlap=True))
    assert not any(waiting_follow_ons)


@pytest.mark.parametrize("overlap", [True, False])
def test_host_reads_step_n_after_launching_step_n_plus_1(stories_model, stories_tokenizer, monkeypatch, overlap):
    """Record the engine's forwards and token reads: with overlap, read i comes after forward i + 2 (the prompt's,
    then one a step) and that forward's input ids are the very device tensor read i copies back; the control
    (overlap off) reads each step before launching the next, from ids built on the host."""
    engine = _engine(stories_model, stories_tokenizer, overlap)
    events: list[tuple[str, object]] = []
    run, read, read_launched = engine.runner.run, loop_module.read_step_tokens, overlap_module.LaunchedStep.tokens

    def recording_run(ids, *args, **kwargs):
        events.append(("run", ids))
        return run(ids, *args, **kwargs)

    def recording_read(sampled, emitted):  # the engine's read without overlap
        events.append(("read", sampled))
        return read(sampled, emitted)

    def recording_read_launched(step):  # with overlap
        events.append(("read", step.sampled))
        return read_launched(step)

    monkeypatch.setattr(engine.runner, "run", recording_run)
    monkeypatch.setattr(loop_module, "read_step_tokens", recording_read)
    monkeypatch.setattr(overlap_module.LaunchedStep, "tokens", recording_read_launched)
    engine.generate(["Once upon a time", "Tom"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    reads = [i for i, (kind, _) in enumerate(events) if kind == "read"]
    runs_before = [sum(kind == "run" for kind, _ in events[:i]) for i in reads]
    assert len(reads) == 8
    if overlap:
        assert runs_before == [i + 2 for i in range(7)] + [8]
        assert all(events[i - 1][1] is events[i][1] for i in reads[:-1])  # the next ids are the read's tensor
    else:
        assert runs_before == [i + 1 for i in range(8)]
        assert not any(events[i + 1][1] is events[i][1] for i in reads[:-1])


def test_requeue_running_drops_the_step_in_flight(stories_model, stories_tokenizer):
    """A server's recovery after a step raised (`Engine.requeue_running`) with a step in flight: its requests
    recompute from their first token and end with the tokens of the engine without overlap (greedy: a sampled
    request's generator has drawn for the dropped step, docs/cuda_graphs.md); every page comes back."""
    outputs = {}
    for overlap in (False, True):
        engine = _engine(stories_model, stories_tokenizer, overlap)
        requests = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                    for p, n in (("Once upon a time", 14), ("Tom", 9), ([1] + [300] * 500, 30))]
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps in (3, 7):
                assert (engine._pending is not None) == overlap  # a step is in flight with overlap
                engine.requeue_running()
        assert engine.pool.num_free == engine.pool.num_pages
        outputs[overlap] = [(r.output_ids, r.finish_reason, r.num_preemptions) for r in requests]
    assert outputs[True] == outputs[False]
    assert [len(ids) for ids, _, _ in outputs[True]] == [14, 9, 11]  # the last one ends at the context (512)
    assert [n for _, _, n in outputs[True]] == [2, 2, 2]
