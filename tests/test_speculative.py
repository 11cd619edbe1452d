"""Speculative decoding end to end on stories260K, against decoding without a drafter and against the model itself.

- Greedy: with a draft LM (the target itself) and with an MTP head (untrained), for K = 1..4, outputs are token for
  token those of the engine without a drafter, for a batch of mixed prompt lengths with natural and length stops;
  also under preemption (tiny pages), chunked prefill and requests arriving mid-run. A divergence is tolerated only
  at a genuine near-tie: the target's own top two logits there, computed directly, differ by less than 1e-5.
- Acceptance: the target drafting for itself accepts every draft (tau = K + 1); an untrained head rarely does.
- Pages: after every step each live request holds exactly the pages its longer cache needs, the pool's used pages
  are exactly those in page tables, and everything is back in the pool at the end.
- Sampling: tests/test_speculative_sampling.py.
- Edges: stop strings inside accepted drafts, the context limit, prefills ending in a one-token chunk, the token
  budget of a verify forward.
- The drafter seam: tests/test_drafter_seam.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor

from infer.engine import Engine, EngineConfig, Request
from infer.kv_cache import build_page_metadata, pages_needed
from infer.model_runner import ModelRunner
from infer.models.common import ModelOutput
from infer.models.mtp_head import init_head_from_target
from infer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STORY_END = 1  # stories260K ends a story with BOS; its generation_config's eos (2) never comes
NEAR_TIE = 1e-5  # a greedy divergence is excused only where the target's top two logits are closer than this

# A story the model tells greedily from "The cat" (it then emits STORY_END). Prompts are windows of its tokens that
# end some tokens before the story does, so that greedy decoding soon reaches the end of the story and stops.
STORY = (
    "The cat and a boy were playing in the park. They liked to play with their toys and run around the park. They "
    "liked to play with their toys and seek.\nOne day, a little boy named Tim came to the park. He saw a big box with "
    "a big box. Tim wanted to play with the box. He said, \"I want to play with it!\"\nTim said, \"Yes, I can play "
    "with you.\" They played together and had fun. Tim was happy to have a new friend.\nTim and his friends played "
    "together. They played together every day. They had lots of fun. Tim and the boy were happy. They played "
    "together every day."
)
# Workloads: (prompt length, tokens between the window's end and the story's end, max_new_tokens).
WORKLOADS = {
    # Mixed lengths, natural and length stops; the comment says how each request ends without speculation.
    "mixed": [
        (1, 5, 24),  # stop after 20 tokens
        (3, 5, 24),  # stop after 3: finishes inside the first speculative steps
        (5, 10, 24),  # stop after 11
        (12, 10, 1),  # length 1: finishes in its prefill step, never speculates
        (24, 20, 24),  # stop after 8
        (40, 20, 7),  # length 7 (the story would stop after 21)
        (50, 30, 24),  # stop after 10
        (60, 30, 24),  # length 24 (the story would stop after 33)
    ],
    # Windows far from the story's end, each running 32 tokens: the caches keep growing while requests speculate.
    "growing": [(n, 150 - 10 * i, 32) for i, n in enumerate((2, 4, 7, 11, 16, 22, 29, 37))],
}

# Engine settings per configuration; "arrivals" maps a step number to the prompts added just before it (the others
# arrive at step 0). Each workload's expected tokens come from its "reference" configuration without a drafter.
CONFIGS = {
    "default": dict(workload="mixed", engine=dict(page_size=16, num_pages=128)),
    # 8-token pages, a 24-token budget: long prompts are prefilled in chunks, in batches with decoding requests;
    # half the prompts arrive (at step 8) once the first half has started speculating.
    "chunked": dict(workload="mixed", engine=dict(page_size=8, num_pages=128, max_num_batched_tokens=24),
                    arrivals={8: [1, 3, 5, 7]}),
    "growing": dict(workload="growing", engine=dict(page_size=16, num_pages=128)),
    # 4-token pages, 48 of them for ~100 pages of demand: requests are preempted (and recomputed) after speculating.
    "preempt": dict(workload="growing", engine=dict(page_size=4, num_pages=48)),
}
REFERENCE = {"mixed": "default", "growing": "growing"}

# --- helpers -------------------------------------------------------------------------------------------------------


@torch.no_grad()
def packed_prefill(model: torch.nn.Module, sequences: list[list[int]], hidden: Tensor | None = None) -> ModelOutput:
    """One packed prefill of `sequences` on a fresh paged cache; logits at each sequence's last position ([B, V]).

    hidden ([T, H], packed like the tokens) is for an MTP head."""
    page_size = 16
    lengths = [len(s) for s in sequences]
    counts = [pages_needed(n, page_size) for n in lengths]
    firsts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    runner = ModelRunner(model, firsts[-1], page_size, "torch")
    page_lists = [list(range(firsts[i], firsts[i + 1])) for i in range(len(sequences))]
    meta = build_page_metadata(page_lists, lengths, lengths, page_size, runner.device)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    last_rows = torch.tensor(lengths).cumsum(0) - 1
    extra = {} if hidden is None else {"hidden_states": hidden}
    return runner.run(ids, meta, last_rows, **extra)


@dataclass
class Run:
    """One engine run over a batch, with what the page invariants and preemptions looked like along the way."""

    requests: list[Request]
    spec: dict | None  # engine.spec_stats.to_dict()
    violations: list[str] = field(default_factory=list)
    preempted_after_speculating: int = 0  # preemptions of requests that had already verified drafts
    verify_steps_at_arrivals: list[int] = field(default_factory=list)  # engine's verify steps when late prompts came
    free_at_end: int = 0
    num_pages: int = 0

    @property
    def outputs(self) -> list[list[int]]:
        return [r.output_ids for r in self.requests]


def page_violations(engine: Engine, step: int) -> list[str]:
    """Every live request holds ceil(num_computed / page_size) pages (without a drafter, up to the
    decode_run_steps - 1 tokens more that a decode run reserves; a drafter's cache lives in the same pages, never
    longer), waiting ones none; the pool's used pages are exactly the pages in tables, none in two tables."""
    problems = []
    page_size = engine.config.page_size
    ahead = engine.config.decode_run_steps - 1 if engine.drafter is None else 0
    for r in engine.running:
        want = pages_needed(r.num_computed, page_size)
        if not want <= len(r.page_table.pages) <= pages_needed(r.num_computed + ahead, page_size):
            problems.append(f"step {step}: request {r.request_id} holds {len(r.page_table.pages)} pages for "
                            f"num_computed={r.num_computed} (wants {want})")
    for r in engine.waiting:
        if r.page_table.pages:
            problems.append(f"step {step}: waiting request {r.request_id} holds pages {r.page_table.pages}")
    held = [p for r in [*engine.running, *engine.waiting] for p in r.page_table.pages]
    if len(set(held)) != len(held):
        problems.append(f"step {step}: a page is in two tables: {sorted(held)}")
    used = engine.pool.num_pages - engine.pool.num_free
    if used != len(held):
        problems.append(f"step {step}: {used} pages allocated, {len(held)} in page tables")
    return problems


def drive(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], arrivals: dict[int, list[int]] | None = None
) -> Run:
    """Step the engine to completion, adding prompts at their arrival steps and checking pages after every step."""
    arrivals = arrivals or {}
    late = {i for ids in arrivals.values() for i in ids}
    requests: dict[int, Request] = {i: engine.add_request(prompts[i], params[i]) for i in range(len(prompts))
                                    if i not in late}
    run = Run([], None)
    step = 0
    while engine.has_unfinished() or len(requests) < len(prompts):
        if step in arrivals:
            run.verify_steps_at_arrivals.append(engine.spec_stats.verify_steps if engine.spec_stats else 0)
        for i in arrivals.get(step, []):
            requests[i] = engine.add_request(prompts[i], params[i])
        verified_before = {r.request_id: r.spec_stats.verify_steps if r.spec_stats else 0 for r in engine.running}
        preemptions_before = {r.request_id: r.num_preemptions for r in engine.running}
        finished = engine.step()
        for r in finished:
            if r.page_table.pages:
                run.violations.append(f"step {step}: finished request {r.request_id} kept {r.page_table.pages}")
        for r in [*engine.running, *engine.waiting]:
            if r.num_preemptions > preemptions_before.get(r.request_id, r.num_preemptions):
                run.preempted_after_speculating += verified_before[r.request_id] > 0
        run.violations += page_violations(engine, step)
        step += 1
        assert step < 2000, "the engine does not finish"
    run.requests = [requests[i] for i in range(len(prompts))]
    run.spec = engine.spec_stats.to_dict() if engine.spec_stats else None
    run.free_at_end, run.num_pages = engine.pool.num_free, engine.pool.num_pages
    return run


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_identical(target: torch.nn.Module, prompts: list[list[int]], expected: Run, got: Run) -> int:
    """Token-for-token equality, except at a proven near-tie (then the continuations differ and are not compared).

    Returns the number of near-ties excused."""
    near_ties = 0
    for i, (prompt, want, have) in enumerate(zip(prompts, expected.requests, got.requests)):
        j = first_divergence(want.output_ids, have.output_ids)
        if j is None:
            assert want.finish_reason == have.finish_reason, f"prompt {i}: {have.finish_reason} != {want.finish_reason}"
            continue
        assert j < min(len(want.output_ids), len(have.output_ids)), (
            f"prompt {i}: same tokens but {len(have.output_ids)} generated instead of {len(want.output_ids)} "
            f"({have.finish_reason} vs {want.finish_reason})"
        )
        logits = packed_prefill(target, [prompt + want.output_ids[:j]]).logits[0]
        top2 = logits.topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        assert {want.output_ids[j], have.output_ids[j]} == set(top2.indices.tolist()) and gap < NEAR_TIE, (
            f"prompt {i} diverges at output token {j}: {have.output_ids[j]} instead of {want.output_ids[j]}; the "
            f"target's top two there are {top2.indices.tolist()} with logit gap {gap:.2e} (not a near-tie)"
        )
        near_ties += 1
    return near_ties


# --- fixtures ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workloads(stories_tokenizer) -> dict[str, tuple[list[list[int]], list[SamplingParams]]]:
    """name -> (prompts, greedy params)."""
    story = stories_tokenizer.encode(STORY)  # BOS + the story; the model would emit STORY_END next
    return {
        name: (
            [story[len(story) - m - n : len(story) - m] for n, m, _ in windows],
            [SamplingParams(max_new_tokens=max_new, stop_token_ids=(STORY_END,)) for _, _, max_new in windows],
        )
        for name, windows in WORKLOADS.items()
    }


@pytest.fixture(scope="module")
def untrained_head(stories_model):
    return init_head_from_target(stories_model, "stories260K")


@pytest.fixture(scope="module")
def runs(stories_model, stories_tokenizer, untrained_head, workloads):
    """Greedy runs, computed once and shared by the tests that read them: runs(drafter, k, config)."""
    cache: dict[tuple[str, int, str], Run] = {}
    drafters = {"none": None, "draft": ("draft", stories_model), "mtp": ("mtp", untrained_head)}

    def get(drafter: str, k: int, config: str) -> Run:
        if (drafter, k, config) not in cache:
            setting = CONFIGS[config]
            engine = Engine(stories_model, stories_tokenizer, [2],
                            EngineConfig(num_draft_tokens=k, backend="torch", **setting["engine"]))
            if drafters[drafter] is not None:
                engine.attach_drafter(*drafters[drafter])
            cache[drafter, k, config] = drive(engine, *workloads[setting["workload"]], setting.get("arrivals"))
        return cache[drafter, k, config]

    return get


@pytest.fixture(scope="module")
def baseline(runs) -> Run:
    """The mixed workload without a drafter."""
    run = runs("none", 1, "default")
    reasons = [r.finish_reason for r in run.requests]
    # The batch exercises what it is meant to: natural stops, length stops, a request done at its prefill.
    assert reasons.count("stop") >= 4 and reasons.count("length") >= 2, reasons
    assert any(len(r.output_ids) == 1 for r in run.requests)
    return run


GREEDY_CASES = [(config, d, k) for config in CONFIGS for d in ("draft", "mtp") for k in (1, 2, 3, 4)]


# --- greedy identity, acceptance, pages ----------------------------------------------------------------------------


@pytest.mark.parametrize("config,drafter,k", GREEDY_CASES)
def test_greedy_identical_to_no_speculation(runs, baseline, stories_model, workloads, config, drafter, k):
    workload = CONFIGS[config]["workload"]
    expected = runs("none", 1, REFERENCE[workload])
    run = runs(drafter, k, config)

    assert run.spec["verify_steps"] > 0, "the engine never speculated"
    assert_greedy_identical(stories_model, workloads[workload][0], expected, run)


@pytest.mark.parametrize("drafter,k", [(d, k) for d in ("draft", "mtp") for k in (1, 2, 3, 4)])
def test_preemption_during_speculation(runs, drafter, k):
    """The preempt configuration really preempts requests that had speculated (identity is checked above)."""
    run = runs(drafter, k, "preempt")

    assert any(r.num_preemptions for r in run.requests)
    assert run.preempted_after_speculating > 0


@pytest.mark.parametrize("drafter,k", [(d, k) for d in ("draft", "mtp") for k in (1, 2, 3, 4)])
def test_chunked_configuration_mixes_arrivals_into_speculation(runs, drafter, k):
    """Late prompts arrive after the engine has speculated, and their (chunked) prefills interrupt it."""
    run = runs(drafter, k, "chunked")

    assert run.verify_steps_at_arrivals and run.verify_steps_at_arrivals[0] > 0
    assert run.spec["verify_steps"] > run.verify_steps_at_arrivals[0]


@pytest.mark.parametrize("config,k", [(config, k) for config in CONFIGS for k in (1, 2, 3, 4)])
def test_target_as_its_own_drafter_accepts_every_draft(runs, config, k):
    run = runs("draft", k, config)

    assert run.spec["acceptance_per_position"] == [1.0] * k
    assert run.spec["tau"] == k + 1
    assert run.spec["accepted_length_histogram"] == [0] * k + [run.spec["verify_steps"]]
    speculated = [r for r in run.requests if r.spec_stats.verify_steps]
    assert len(speculated) >= 5
    for r in speculated:  # per request too
        stats = r.spec_stats
        assert stats.accepted_per_position == [stats.verify_steps] * k, r.request_id
        assert stats.emitted == stats.verify_steps * (k + 1) and stats.tau == k + 1, r.request_id


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_untrained_head_is_rarely_accepted(runs, k):
    """A head that only re-applies the last layer to h_i is a weak guess; its output is still exact (above)."""
    run = runs("mtp", k, "default")

    assert run.spec["verify_steps"] >= 20
    assert run.spec["acceptance_per_position"][0] < 0.3
    acceptance = run.spec["acceptance_per_position"]
    assert all(a >= b for a, b in zip(acceptance, acceptance[1:]))  # accepting j+1 requires accepting j


@pytest.mark.parametrize("config,drafter,k", [*[(c, "none", 1) for c in CONFIGS], *GREEDY_CASES])
def test_pages_match_caches_every_step_and_all_return(runs, config, drafter, k):
    run = runs(drafter, k, config)

    assert not run.violations, "\n".join(run.violations[:10])
    assert run.free_at_end == run.num_pages


@pytest.mark.parametrize("drafter", ["draft", "mtp"])
def test_stop_strings_identical(stories_model, stories_tokenizer, untrained_head, workloads, drafter):
    """A stop string met inside a run of accepted drafts ends the request at the same token, with the same text."""
    prompts, _ = workloads["mixed"]
    params = [SamplingParams(max_new_tokens=24, stop=("fun", "Tim "))] * len(prompts)
    results = []
    for kind in (None, drafter):
        engine = Engine(stories_model, stories_tokenizer, [2],
                        EngineConfig(num_draft_tokens=3, backend="torch", page_size=16, num_pages=128))
        if kind:
            engine.attach_drafter(kind, stories_model if kind == "draft" else untrained_head)
        run = drive(engine, prompts, params)
        assert not run.violations and run.free_at_end == run.num_pages
        results.append([(r.output_ids, r.text, r.finish_reason) for r in run.requests])
    assert sum(reason == "stop" for _, _, reason in results[0]) >= 2
    assert results[1] == results[0]


def test_greedy_identical_at_the_context_limit(stories_model, stories_tokenizer, untrained_head):
    """A prompt 6 tokens short of max_position_embeddings: speculation must stop short of the limit, not write
    past it, and the request ends by length after exactly 6 tokens."""
    story = stories_tokenizer.encode(STORY)
    limit = stories_model.config.max_position_embeddings
    prompt = (story * (limit // len(story) + 1))[: limit - 6]
    params = SamplingParams(max_new_tokens=50, stop_token_ids=(STORY_END,))
    outputs = []
    for drafter in (None, ("draft", stories_model), ("mtp", untrained_head)):
        engine = Engine(stories_model, stories_tokenizer, [2],
                        EngineConfig(num_draft_tokens=4, backend="torch", page_size=16, num_pages=40))
        if drafter:
            engine.attach_drafter(*drafter)
        run = drive(engine, [prompt], [params])
        assert not run.violations and run.free_at_end == run.num_pages
        outputs.append((run.outputs[0], run.requests[0].finish_reason))
    assert outputs[0][1] == "length" and len(outputs[0][0]) == 6
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


@pytest.mark.parametrize("drafter", ["draft", "mtp"])
@pytest.mark.parametrize("prompt_len,budget", [(1, 64), (17, 16), (33, 16)], ids=["1-token prompt", "17/16", "33/16"])
def test_prefill_ending_in_a_one_token_chunk(stories_model, stories_tokenizer, untrained_head, drafter, prompt_len,
                                             budget):
    """A request whose prefill (or its last chunk) is a single token looks like a decode step to the scheduler: the
    engine must still produce the tokens of decoding without a drafter (a 1-token prompt, or a prompt one token
    longer than a multiple of the token budget, alone in the engine)."""
    story = stories_tokenizer.encode(STORY)
    prompt = story[:prompt_len]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(STORY_END,))
    outputs = []
    for kind in (None, drafter):
        engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(
            num_draft_tokens=2, backend="torch", page_size=8, num_pages=32, max_num_batched_tokens=budget))
        if kind:
            engine.attach_drafter(kind, stories_model if kind == "draft" else untrained_head)
        run = drive(engine, [prompt], [params])
        assert not run.violations and run.free_at_end == run.num_pages
        outputs.append(run.outputs[0])
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize("drafter", ["draft", "mtp"])
def test_verify_forward_stays_within_the_token_budget(stories_model, stories_tokenizer, untrained_head, drafter):
    """max_num_batched_tokens bounds every target forward, the verify of B x (K + 1) tokens included: with 8 decoding
    requests, K = 4 and a budget of 24, the engine may speculate for at most 4 of them per step (or not at all)."""
    story = stories_tokenizer.encode(STORY)
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(
        num_draft_tokens=4, backend="torch", page_size=8, num_pages=64, max_num_batched_tokens=24))
    engine.attach_drafter(drafter, stories_model if drafter == "draft" else untrained_head)
    forward_sizes = []
    run_target = engine.runner.run

    def recording_run(input_ids, *args, **kwargs):
        forward_sizes.append(input_ids.numel())
        return run_target(input_ids, *args, **kwargs)

    engine.runner.run = recording_run
    prompts = [story[3 * i : 3 * i + 3] for i in range(8)]  # 8 x 3 tokens: one prefill step at exactly the budget
    drive(engine, prompts, [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 8)

    assert max(forward_sizes) <= 24, f"target forwards of {sorted(set(forward_sizes))} tokens, budget 24"


def test_target_as_its_own_drafter_accepts_sampled_drafts(stories_model, stories_tokenizer, workloads):
    """q = p when the drafter is the target: a draft is rejected only where float noise makes p(x) < q(x) by a
    hair, so acceptance stays near 1; a draft side filtered or tempered unlike the target's would not. Run in the
    preempting configuration: sampled requests are preempted and recomputed, and every page still adds up."""
    prompts, _ = workloads["growing"]
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=32, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    engine = Engine(stories_model, stories_tokenizer, [2],
                    EngineConfig(num_draft_tokens=3, backend="torch", **CONFIGS["preempt"]["engine"]))
    engine.attach_drafter("draft", stories_model)
    run = drive(engine, prompts, params)

    assert run.spec["verify_steps"] >= 40
    assert min(run.spec["acceptance_per_position"]) >= 0.98, run.spec
    assert run.preempted_after_speculating > 0
    assert not run.violations and run.free_at_end == run.num_pages
    assert all(len(r.output_ids) == 32 for r in run.requests)


@pytest.fixture(scope="module")
def perturbed_draft_lm(stories_model):
    """The target with noise on its (tied) embedding and lm_head: a draft LM that agrees about half the time."""
    model = copy.deepcopy(stories_model)
    gen = torch.Generator().manual_seed(0)
    weight = model.model.embed_tokens.weight
    assert model.lm_head.weight is weight
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=gen) * 0.3 * weight.std())
    return model


def test_seeded_requests_reproduce_and_greedy_neighbours_stay_exact(
    stories_model, stories_tokenizer, perturbed_draft_lm, workloads, baseline
):
    """Sampled (seeded) and greedy requests share speculative batches, drafts often rejected: two identical runs give
    identical tokens, and the greedy requests still equal decoding without a drafter."""
    prompts, greedy_params = workloads["mixed"]
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=20, seed=100 + i, ignore_eos=True)
               for i in range(0, len(prompts), 2)]
    params = [sampled[i // 2] if i % 2 == 0 else greedy_params[i] for i in range(len(prompts))]

    def run() -> Run:
        engine = Engine(stories_model, stories_tokenizer, [2],
                        EngineConfig(num_draft_tokens=3, backend="torch", page_size=16, num_pages=128))
        engine.attach_drafter("draft", perturbed_draft_lm)
        return drive(engine, prompts, params)

    first, second = run(), run()

    assert first.outputs == second.outputs
    assert first.spec["verify_steps"] > 0 and first.spec["accepted_length_histogram"][0] > 0
    sampled_outputs = [tuple(first.outputs[i]) for i in range(0, len(prompts), 2)]
    assert len(set(sampled_outputs)) == len(sampled_outputs) and all(len(o) == 20 for o in sampled_outputs)
    greedy_rows = list(range(1, len(prompts), 2))
    pick = lambda run: Run([run.requests[i] for i in greedy_rows], run.spec)  # noqa: E731
    assert_greedy_identical(stories_model, [prompts[i] for i in greedy_rows], pick(baseline), pick(first))
    assert not first.violations and first.free_at_end == first.num_pages


# --- mixed batches ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["draft", "mtp"])
def test_decodes_speculate_in_the_same_forward_as_arriving_prefills(stories_model, stories_tokenizer, untrained_head,
                                                                    drafter):
    """A stream of arrivals (one every 4 steps): every decode step speculates, in forwards that also prefill the
    newcomers, and the tokens are the plain engine's."""
    story = stories_tokenizer.encode(STORY)
    prompts = [story[5 * i : 5 * i + 9] for i in range(8)]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 8
    arrivals = {4 * i: [i] for i in range(1, 8)}
    plain = drive(Engine(stories_model, stories_tokenizer, [2], EngineConfig(backend="torch", num_pages=64)),
                  prompts, params, arrivals)
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(num_draft_tokens=3, backend="torch",
                                                                        num_pages=64))
    engine.attach_drafter(drafter, stories_model if drafter == "draft" else untrained_head)
    mixed_forwards = []
    run_target = engine.runner.run

    def recording_run(input_ids, meta, *args, **kwargs):
        q_lens = (meta.qo_indptr[1:] - meta.qo_indptr[:-1]).tolist()
        mixed_forwards.append(4 in q_lens and any(q not in (1, 4) for q in q_lens))  # verify rows beside a prefill
        return run_target(input_ids, meta, *args, **kwargs)

    engine.runner.run = recording_run
    run = drive(engine, prompts, params, arrivals)

    assert run.outputs == plain.outputs and not run.violations
    assert run.spec["speculated_share"] == 1.0 and run.spec["verify_steps"] > 0
    assert sum(mixed_forwards) >= 5, "no forward packed verify rows beside a prefill chunk"
