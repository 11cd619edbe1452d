"""The serving loop on stories260K: greedy parity with transformers, batch invariance, continuous batching, chunked
prefill, preemption, stopping, seeded sampling, the context limit, and that every page comes back."""

from __future__ import annotations

import random

import pytest
import torch

from infer.engine import Engine, EngineConfig, Request
from infer.kv_cache import DecodeSteps
from infer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# What greedy decoding from BOS begins with (shared/assets/README.md).
REFERENCE_STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)
STORY_END = 1  # stories260K ends a story with BOS; its generation_config's eos (2) never comes
PROMPTS = [
    "Once upon a time",
    "Tom",
    "The cat sat on the mat and",
    "Lily wanted to play with her friend Ben, but he was sick. She",
    "One day, a big dog",
    "Sue had a red ball. She liked to throw it high in the sky. One day, the ball went over the fence and into "
    "the garden of an old man. Sue was scared, but she",
    "Once upon a time, there was a little bird",
    "Mom said",
]


def greedy(max_new_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(STORY_END,), **kwargs)


@pytest.fixture
def make_engine(stories_model, stories_tokenizer):
    """Engines over the session's model, eos ids as the folder's generation_config gives them ([2])."""
    engines: list[Engine] = []

    def make(**config) -> Engine:
        config = dict(page_size=4, num_pages=512, backend="torch") | config
        engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(**config))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:  # whatever a test did, no page may stay allocated once nothing is left to run
        if not engine.has_unfinished():
            assert engine.pool.num_free == engine.pool.num_pages, "pages leaked"


def run_to_completion(engine: Engine, requests: list[Request] | None = None) -> list[Request]:
    requests = requests if requests is not None else list(engine.waiting)
    while engine.has_unfinished():
        engine.step()
    assert all(r.finished for r in requests)
    assert engine.pool.num_free == engine.pool.num_pages, "pages leaked"
    return requests


def run_alone(engine: Engine, prompt, params: SamplingParams) -> Request:
    assert not engine.has_unfinished()
    (request,) = engine.generate([prompt], params)
    assert engine.pool.num_free == engine.pool.num_pages
    return request


# --- greedy parity ----------------------------------------------------------------------------------------------


def test_greedy_from_bos_tells_the_reference_story(make_engine):
    (request,) = make_engine().generate([[1]], greedy(48))
    assert request.text.startswith(REFERENCE_STORY), request.text
    assert request.finish_reason == "length" and len(request.output_ids) == 48


def test_greedy_from_text_prompt_continues_the_story(make_engine, stories_tokenizer):
    (request,) = make_engine().generate(["Once upon a time"], greedy(40))
    assert request.prompt == "Once upon a time"
    assert request.prompt_ids == stories_tokenizer.encode("Once upon a time")
    assert ("Once upon a time" + request.text).startswith(REFERENCE_STORY)


def test_natural_stop_at_the_end_of_the_story(make_engine):
    """The first greedy story ends with token 1 after 346 tokens; the stop token is kept in output_ids."""
    (request,) = make_engine(page_size=16, num_pages=64).generate([[1]], greedy(400))
    assert request.finish_reason == "stop"
    assert request.output_ids[-1] == STORY_END and STORY_END not in request.output_ids[:-1]
    assert len(request.output_ids) == 346
    assert request.text.startswith(REFERENCE_STORY) and request.text.endswith('You are a good friend."')


def test_batch_of_mixed_lengths_equals_each_prompt_alone(make_engine):
    batch_engine = make_engine()
    batched = batch_engine.generate(PROMPTS, greedy(24))
    assert sorted({len(r.prompt_ids) for r in batched}) == sorted(len(r.prompt_ids) for r in batched)  # all differ
    solo_engine = make_engine()
    for request in batched:
        alone = run_alone(solo_engine, request.prompt, greedy(24))
        assert request.output_ids == alone.output_ids, request.prompt
        assert request.text == alone.text and request.finish_reason == alone.finish_reason


@torch.no_grad()
def test_greedy_matches_transformers_generate(make_engine, stories_reference):
    engine = make_engine()
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[5]]
    requests = engine.generate(prompts, greedy(32))
    for request in requests:
        prompt_ids = torch.tensor([request.prompt_ids])
        ref = stories_reference.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=32, do_sample=False,
            eos_token_id=STORY_END, pad_token_id=0,
        )
        assert request.output_ids == ref[0, prompt_ids.shape[1] :].tolist(), request.prompt


# --- scheduling -------------------------------------------------------------------------------------------------


def test_requests_added_while_others_run_finish_correctly(make_engine):
    """Continuous batching: new requests join between steps, while earlier ones are mid-decode."""
    solo_engine = make_engine()
    expected = [run_alone(solo_engine, p, greedy(20 + 3 * i)).output_ids for i, p in enumerate(PROMPTS[:5])]
    engine = make_engine()
    requests, finished, overlapped = [], [], False
    for i, prompt in enumerate(PROMPTS[:5]):
        requests.append(engine.add_request(prompt, greedy(20 + 3 * i)))
        for _ in range(4):
            finished += engine.step()
        overlapped |= len(engine.running) > 1
    while engine.has_unfinished():
        finished += engine.step()
    assert overlapped, "no two requests ever ran together"
    assert sorted(r.request_id for r in finished) == [r.request_id for r in requests]  # each reported exactly once
    assert [r.output_ids for r in requests] == expected
    assert engine.pool.num_free == engine.pool.num_pages


def test_max_num_seqs_caps_the_running_batch(make_engine):
    engine = make_engine(max_num_seqs=2)
    requests = [engine.add_request(p, greedy(10)) for p in PROMPTS[:5]]
    while engine.has_unfinished():
        engine.step()
        assert len(engine.running) <= 2
    solo_engine = make_engine()
    for request in requests:
        assert request.output_ids == run_alone(solo_engine, request.prompt, greedy(10)).output_ids


def test_chunked_prefill_gives_the_same_tokens(make_engine, stories_tokenizer):
    """max_num_batched_tokens=8 splits a 40-token prompt into 5 chunks, also while another request decodes."""
    prompt_ids = stories_tokenizer.encode(PROMPTS[5])[:40]
    assert len(prompt_ids) == 40
    unchunked = run_alone(make_engine(), prompt_ids, greedy(16))
    engine = make_engine(max_num_batched_tokens=8)
    chunked = run_alone(engine, prompt_ids, greedy(16))
    assert engine.num_steps == 5 + 16 - 1  # five prefill chunks, the last one samples the first new token
    assert chunked.output_ids == unchunked.output_ids
    # The same prompt chunked while a short request decodes beside it.
    other = engine.add_request(PROMPTS[1], greedy(30))
    engine.step()
    again = engine.add_request(prompt_ids, greedy(16))
    run_to_completion(engine, [other, again])
    assert again.output_ids == unchunked.output_ids
    assert other.output_ids == run_alone(make_engine(), PROMPTS[1], greedy(30)).output_ids


def test_preemption_recomputes_and_keeps_the_tokens(make_engine):
    """24 pages of 4 tokens hold one 61-token sequence and a half: six requests must take turns, preempting one
    another, and still give an ample engine's tokens (greedy and seeded sampling alike)."""
    prompts = [[1], [1, 403], [1, 274, 287], PROMPTS[1], PROMPTS[4], PROMPTS[7]]
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True)] * 4 + [
        SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=1.0, seed=11),
        SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.8, top_p=0.9, seed=12),
    ]
    ample = make_engine().generate(prompts, params)
    tight_engine = make_engine(num_pages=24)
    tight = tight_engine.generate(prompts, params)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 60 for r in tight)
    assert [r.output_ids for r in tight] == [r.output_ids for r in ample]
    assert sum(r.num_preemptions for r in tight) > 0
    assert all(r.num_preemptions == 0 for r in ample)
    assert tight_engine.pool.num_free == tight_engine.pool.num_pages


def test_request_larger_than_the_whole_cache_never_crashes_mid_run(make_engine):
    """12 pages of 4 tokens (48 slots) cannot hold BOS + 60 new tokens. The engine must either refuse such a
    request up front (ValueError naming the KV cache) or finish every request; not raise mid-run after others
    already ran, losing their work."""
    engine = make_engine(num_pages=12)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    try:
        requests = [engine.add_request([1], params) for _ in range(6)]
    except ValueError as err:
        assert "KV cache" in str(err) or "pages" in str(err), err
        return
    run_to_completion(engine, requests)


def test_random_schedules_give_the_ample_engines_tokens(make_engine):
    """Random prompts, arrivals between steps, tiny token budgets, pages of 1-4 tokens, pools barely larger than
    the longest request (so chunking, batching caps and preemption all mix) and decode runs of 2 or 8 steps: every
    request's tokens, greedy or seeded, equal those of an ample engine that ran them all at once building each
    step's metadata alone, and every page comes back."""
    rng = random.Random(0)
    total_preemptions = 0
    for _ in range(8):
        n = rng.randrange(3, 9)
        prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 30))] for _ in range(n)]
        params = [
            SamplingParams(max_new_tokens=rng.randrange(1, 40), ignore_eos=True, temperature=rng.choice([0.0, 0.0, 1.0]),
                           seed=rng.randrange(100))
            for _ in range(n)
        ]
        expected = make_engine(decode_run_steps=1).generate(prompts, params)
        page_size = rng.choice([1, 2, 4])
        longest = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
        engine = make_engine(
            page_size=page_size, num_pages=-(-longest // page_size) + rng.randrange(0, 6),
            max_num_batched_tokens=rng.choice([1, 3, 8, 64]), max_num_seqs=rng.choice([1, 2, 8]),
            decode_run_steps=rng.choice([2, 8]),
        )
        requests, pending = [], list(zip(prompts, params))
        while pending or engine.has_unfinished():
            if pending and rng.random() < 0.5:
                requests.append(engine.add_request(*pending.pop(0)))
            engine.step()
        assert [r.output_ids for r in requests] == [r.output_ids for r in expected]
        assert engine.pool.num_free == engine.pool.num_pages
        total_preemptions += sum(r.num_preemptions for r in requests)
    assert total_preemptions > 0


def test_decode_runs_plan_once_per_run_and_give_the_per_step_tokens(make_engine, monkeypatch):
    """An unchanged batch of decodes builds its metadata (and its attention plan) once per run of decode_run_steps
    steps, not once per step, with the tokens of per-step builds; a control whose steps all reuse the run's first
    step's metadata gives other tokens, so the comparison can fail."""
    import infer.engine.forward as forward_module
    import infer.model_runner as runner_module

    prompts, params = PROMPTS[:4], SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = [r.output_ids for r in make_engine(decode_run_steps=1).generate(prompts, params)]
    builds = {"run": 0, "step": 0}

    def counted(name, build):
        def wrapper(*args, **kwargs):
            builds[name] += 1
            return build(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(runner_module, "DecodeSteps", counted("run", runner_module.DecodeSteps))
    monkeypatch.setattr(forward_module, "build_page_metadata", counted("step", forward_module.build_page_metadata))
    engine = make_engine(decode_run_steps=8)
    assert [r.output_ids for r in engine.generate(prompts, params)] == expected
    assert builds == {"run": 5, "step": 1}  # the prefill, then 39 decode steps in runs of 8, 8, 8, 8 and 7

    monkeypatch.setattr(DecodeSteps, "step", lambda run, j, step=DecodeSteps.step: step(run, 0))
    assert [r.output_ids for r in make_engine(decode_run_steps=8).generate(prompts, params)] != expected


# --- stopping ---------------------------------------------------------------------------------------------------


def test_stop_on_the_engines_eos_ids_and_on_stop_token_ids(make_engine, stories_model, stories_tokenizer):
    (story,) = make_engine().generate([[1]], greedy(20))
    stop_id = story.output_ids[7]  # a token greedy decoding emits: stop at its first occurrence
    first = story.output_ids.index(stop_id)
    engine = Engine(stories_model, stories_tokenizer, [stop_id], EngineConfig(page_size=4, num_pages=64, backend="torch"))
    by_eos = run_alone(engine, [1], SamplingParams(max_new_tokens=20))  # the engine's eos ids apply by default
    by_param = run_alone(make_engine(), [1], SamplingParams(max_new_tokens=20, stop_token_ids=(stop_id,)))
    for request in (by_eos, by_param):
        assert request.finish_reason == "stop"
        assert request.output_ids == story.output_ids[: first + 1]
    ignored = run_alone(engine, [1], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert ignored.finish_reason == "length" and ignored.output_ids == story.output_ids


def test_stop_on_max_new_tokens(make_engine):
    requests = make_engine().generate(PROMPTS[:3], [greedy(1), greedy(5), greedy(13)])
    assert [len(r.output_ids) for r in requests] == [1, 5, 13]
    assert all(r.finish_reason == "length" for r in requests)


def test_a_verify_steps_tokens_settle_as_appended_one_at_a_time(make_engine):
    """A verify step's emitted tokens settled at once (`append_verified`) leave a request as `append` leaves it
    token by token: the tokens kept up to the first stop id or the length limit (new tokens or the context), the
    settled prefix, the finish reason, the text, the pages freed. Random emissions of 1-5 tokens with stop ids;
    settling every emitted token (the broken control) differs."""
    rng = random.Random(0)
    by_one, at_once, control = make_engine(), make_engine(), make_engine()
    differs = 0
    for _ in range(300):
        params = SamplingParams(max_new_tokens=rng.randint(1, 6), stop_token_ids=(7, 9) if rng.random() < 0.5 else None,
                                ignore_eos=rng.random() < 0.2)
        prompt = [1] + [rng.randint(10, 500) for _ in range(rng.choice([3, 506, 509]))]  # some at the context's end
        states = []
        for engine in (by_one, at_once, control):
            request = engine.add_request(prompt, params)
            engine.waiting.clear()
            request.page_table.extend(len(prompt))
            request.num_computed = len(prompt) - 1  # the prompt in the cache but its last token, as after a decode
            states.append(request)
        emitted = [rng.choice([2, 7, 9, rng.randint(10, 500)]) for _ in range(rng.randint(1, 5))]
        one, once, naive = states
        stopped = any(by_one.output.append(one, token, settle=True) for token in emitted)
        assert at_once.output.append_verified(once, emitted) == stopped
        fields = lambda r: (r.output_ids, r.token_ids, r.num_computed, r.finish_reason, r.text,  # noqa: E731
                            r.page_table.pages)
        assert fields(once) == fields(one), (emitted, params)
        naive.num_computed = naive.num_tokens + len(emitted) - 1
        naive.output_ids.extend(emitted)
        naive.token_ids.extend(emitted)
        differs += fields(naive)[:3] != fields(one)[:3]
        for request in states:
            request.page_table.free()
    assert differs > 50


def test_stop_string_truncates_the_text_before_it(make_engine):
    engine = make_engine()
    (request,) = engine.generate([[1]], greedy(40, stop=("Lily",)))
    assert request.finish_reason == "stop"
    assert request.text == "Once upon a time, there was a little girl named "
    assert len(request.output_ids) < 40
    # The earliest of several stop strings wins, whichever is listed first.
    (request,) = engine.generate([[1]], greedy(60, stop=("park", "girl")))
    assert request.text == "Once upon a time, there was a little " and request.finish_reason == "stop"


def test_stop_string_after_a_text_prompt_looks_at_the_output_only(make_engine):
    """"time" is in the prompt: only generated text is searched, and text keeps its leading space."""
    engine = make_engine()
    (request,) = engine.generate(["Once upon a time"], greedy(40, stop=("time", "named")))
    assert request.finish_reason == "stop"
    assert request.text == ", there was a little girl "
    (request,) = engine.generate(["Once upon a time, there was a little"], greedy(40, stop=("Lily",)))
    assert request.text == " girl named "


def test_stop_string_at_the_very_start_leaves_empty_text(make_engine):
    (request,) = make_engine().generate([[1]], greedy(40, stop=("Once",)))
    assert request.finish_reason == "stop"
    assert request.text == ""


# --- sampling ---------------------------------------------------------------------------------------------------


def sampled(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=seed, stop_token_ids=(STORY_END,), **kwargs)


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine):
    prompt = PROMPTS[0]
    first = run_alone(make_engine(), prompt, sampled(7))
    second = run_alone(make_engine(), prompt, sampled(7))
    assert first.output_ids == second.output_ids
    # The same request in a batch with greedy, other seeded and unseeded requests, added after some have started.
    engine = make_engine()
    others = [engine.add_request(PROMPTS[5], greedy(30)), engine.add_request(prompt, sampled(8))]
    engine.step()
    target = engine.add_request(prompt, sampled(7))
    others.append(engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=30, temperature=0.7, top_k=20)))
    run_to_completion(engine, others + [target])
    assert target.output_ids == first.output_ids
    assert others[1].output_ids != first.output_ids  # another seed, another story
    greedy_story = run_alone(make_engine(), prompt, greedy(24))
    assert first.output_ids != greedy_story.output_ids  # it did sample


def test_unseeded_sampling_follows_torch_manual_seed(make_engine):
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    torch.manual_seed(3)
    a = run_alone(make_engine(), [1], params)
    torch.manual_seed(3)
    b = run_alone(make_engine(), [1], params)
    assert a.output_ids == b.output_ids


# --- limits and validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [512, 600])
def test_prompt_at_or_past_the_context_is_refused(make_engine, length):
    engine = make_engine()
    with pytest.raises(ValueError) as info:
        engine.add_request([1] + [300] * (length - 1), greedy(4))
    message = str(info.value)
    assert str(length) in message and "512" in message and "context" in message
    assert not engine.has_unfinished()


@torch.no_grad()
def test_request_reaching_the_context_ends_with_length(make_engine, stories_reference, stories_tokenizer):
    """A 505-token prompt with room for 7 more tokens: positions reach 511, the last one the model has."""
    story = stories_tokenizer.encode(" ".join([PROMPTS[5]] * 20))[:505]
    assert len(story) == 505
    engine = make_engine(page_size=16, num_pages=64)
    (request,) = engine.generate([story], SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert request.finish_reason == "length"
    assert len(request.output_ids) == 7 and request.num_tokens == 512
    prompt_ids = torch.tensor([story])
    ref = stories_reference.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=7, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    assert request.output_ids == ref[0, 505:].tolist()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        ([1, 512], SamplingParams(), "token ids"),
        ([1, -1], SamplingParams(), "token ids"),
        ([1], SamplingParams(temperature=-1.0), "temperature"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(top_k=-5), "top_k"),
        ([1], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1], SamplingParams(stop_token_ids=(512,)), "stop_token_ids"),
    ],
)
def test_add_request_rejects_bad_input(make_engine, prompt, params, match):
    engine = make_engine()
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_from_pretrained_reads_the_folder(stories_hf_dir):
    engine = Engine.from_pretrained(stories_hf_dir, page_size=4, num_pages=32, backend="torch")
    assert engine.eos_token_ids == {2}  # generation_config.json's eos, as transformers reads it
    assert engine.tokenizer is not None and engine.pool.num_pages == 32 and engine.max_model_len == 512
    (request,) = engine.generate(["Once upon a time"], SamplingParams(max_new_tokens=12))
    assert REFERENCE_STORY.startswith("Once upon a time" + request.text)


def test_text_prompt_without_tokenizer_is_refused(stories_model):
    engine = Engine(stories_model, None, [], EngineConfig(page_size=4, num_pages=16, backend="torch"))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("Once upon a time")
    (request,) = engine.generate([[1]], SamplingParams(max_new_tokens=3))  # token ids still work
    assert len(request.output_ids) == 3 and request.text == ""


def test_abort_frees_a_running_and_a_waiting_request_at_once_and_the_others_finish_as_alone(make_engine):
    """A server's cancel: the aborted requests' pages come back before the next step; the rest are untouched."""
    engine = make_engine(max_num_seqs=2)
    alone = [run_alone(engine, p, greedy(12)).output_ids for p in PROMPTS[:2]]
    keep, running, waiting = (engine.add_request(p, greedy(12)) for p in PROMPTS[:3])
    for _ in range(3):
        engine.step()
    held = engine.pool.num_pages - engine.pool.num_free
    assert running in engine.running and waiting in engine.waiting and running.page_table.pages
    engine.abort(running)
    engine.abort(waiting)
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert engine.pool.num_pages - engine.pool.num_free == len(keep.page_table.pages) < held
    run_to_completion(engine, [keep])
    assert keep.output_ids == alone[0] and len(running.output_ids) < 12


def test_requeue_running_recomputes_every_running_request_with_the_same_tokens(make_engine):
    """A step that raised leaves its requests' state unknown: requeued, they are recomputed and end as alone."""
    engine = make_engine()
    alone = [run_alone(engine, p, greedy(16)).output_ids for p in PROMPTS[:3]]
    requests = [engine.add_request(p, greedy(16)) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    assert engine.requeue_running() == requests
    assert engine.pool.num_free == engine.pool.num_pages and list(engine.waiting) == requests
    run_to_completion(engine, requests)
    assert [r.output_ids for r in requests] == alone
    assert all(r.num_preemptions == 1 for r in requests)
