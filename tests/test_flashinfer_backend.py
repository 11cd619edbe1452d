"""The FlashInfer backend's side of the contract, on a CPU: `tests/fake_flashinfer.py` stands in for the package and
attends from nothing but what `plan()` was given, in FlashInfer's documented page layout. Through it the engine gives
the torch backend's tokens (greedy: plain with chunked prefill and mixed lengths, speculative with an MTP head and a draft LM,
and an MLA model; sampled speculation with an MTP head: the same drafts at every step);
every forward is planned once, with its indptrs and lengths on the host, before its layers run; a page
length one short (the newest key dropped) changes the tokens, so the comparison has power. Metadata built for
another device keeps its host copies. The kernels themselves run only on a GPU (`launch/gpu_check.sh`).
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2

import infer.attention.flashinfer_backend
from infer.engine import Engine, EngineConfig
from infer.kv_cache import DecodeSteps, build_page_metadata
from infer.loader import load_model
from infer.models.mtp_head import init_head_from_target
from infer.sampling_params import SamplingParams
from tests import fake_flashinfer
from tests.test_deepseek_v2 import tiny_config as tiny_deepseek_config
from tests.test_speculative import STORY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 400, 301, 280], [1, 65, 300, 259, 270, 290, 310, 330, 350, 370, 390, 410, 430], [1, 259]]


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(infer.attention.flashinfer_backend, "flashinfer_available", lambda: True)
    fake_flashinfer.CALLS.clear()
    return fake_flashinfer


def tokens(model, backend: str, drafter: tuple | None = None, k: int = 3,
           max_new_tokens: int = 24) -> tuple[list, float | None, int]:
    """Greedy outputs of PROMPTS (pages of 4, prefill chunks of at most 8 tokens), tau when speculating (drafter:
    (kind, model)) and the engine's steps."""
    engine = Engine(model, None, [], EngineConfig(page_size=4, num_pages=128, max_num_batched_tokens=8,
                                                  backend=backend, num_draft_tokens=k))
    if drafter is not None:
        engine.attach_drafter(*drafter)
    prompts = [[t % model.config.vocab_size for t in prompt] for prompt in PROMPTS]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    assert engine.pool.num_free == engine.pool.num_pages
    return [r.output_ids for r in out], (engine.spec_stats.tau if engine.spec_stats else None), engine.num_steps


def test_greedy_decoding_gives_the_torch_backends_tokens_one_plan_per_forward(fake, stories_model):
    reference, _, _ = tokens(stories_model, "torch")
    ours, _, steps = tokens(stories_model, "flashinfer")
    assert ours == reference
    plans = [c for c in fake.CALLS if c[0] == "plan"]
    runs = [c for c in fake.CALLS if c[0] == "run"]
    assert len(plans) == steps and len(runs) == 5 * steps  # each step: one plan, then one run per layer
    assert all(devices == {"cpu"} for _, devices in plans)
    assert fake.CALLS[0][0] == "plan"


@pytest.mark.parametrize("drafter", ["mtp", "draft"])
def test_speculation_gives_the_torch_backends_tokens_and_acceptance(fake, stories_model, drafter):
    """An (untrained) MTP head, and the target drafting for itself: every draft accepted, tau = K + 1."""
    model = init_head_from_target(stories_model, "stories260K") if drafter == "mtp" else stories_model
    reference, reference_tau, _ = tokens(stories_model, "torch", (drafter, model))
    ours, tau, _ = tokens(stories_model, "flashinfer", (drafter, model))
    assert ours == reference == tokens(stories_model, "torch")[0] and tau == reference_tau
    if drafter == "draft":
        assert tau == 4.0


def test_sampled_speculation_gives_the_torch_backends_drafts_and_tokens(fake, stories_model, stories_tokenizer):
    """Seeded T=1 requests on a story, where the untrained head's drafts are often accepted: the head's carry (its
    logits and state at each request's last settled row of the catch-up, its last emitted one after a verify) is read
    from every row FlashInfer computes as from the rows the torch backend computes alone, so every step drafts the
    same tokens and emits the same ones."""
    head = init_head_from_target(stories_model, "stories260K")
    story = stories_tokenizer.encode(STORY)
    prompts = [story[:13], story[20:30], story[40:44]]
    runs = {}
    for backend in ("torch", "flashinfer"):
        engine = Engine(stories_model, None, [], EngineConfig(page_size=4, num_pages=128, max_num_batched_tokens=8,
                                                              backend=backend, num_draft_tokens=3))
        engine.attach_drafter("mtp", head)
        drafts, draft = [], engine.drafter.draft

        def recording_draft(seqs, *args, **kwargs):
            ids, probs = draft(seqs, *args, **kwargs)
            drafts.append(([s.request_id for s in seqs], ids.tolist()))
            return ids, probs

        engine.drafter.draft = recording_draft
        params = [SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=1.0, seed=i) for i in range(3)]
        out = engine.generate(prompts, params)
        runs[backend] = (drafts, [r.output_ids for r in out], engine.spec_stats.accepted_length_histogram)
    assert runs["flashinfer"] == runs["torch"]
    assert sum(runs["torch"][2][1:]) > 0, "no draft was ever accepted: a weak check"


def test_mla_model_gives_the_torch_backends_tokens(fake, tmp_path):
    torch.manual_seed(0)
    HFDeepseekV2(tiny_deepseek_config()).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    reference, _, _ = tokens(model, "torch", max_new_tokens=12)
    ours, _, _ = tokens(model, "flashinfer", max_new_tokens=12)
    assert ours == reference


def test_a_page_length_one_short_changes_the_tokens(fake, stories_model, monkeypatch):
    """The broken control: the same comparison fails when the plan drops each sequence's newest key."""
    plan = fake.BatchPrefillWithPagedKVCacheWrapper.plan

    def short(self, qo, kv, pages, last, *args, **kwargs):
        plan(self, qo, kv, pages, last, *args, **kwargs)
        self._plan["last"] = [n - 1 if n > 1 else n for n in self._plan["last"]]

    monkeypatch.setattr(fake.BatchPrefillWithPagedKVCacheWrapper, "plan", short)
    assert tokens(stories_model, "flashinfer")[0] != tokens(stories_model, "torch")[0]


def test_metadata_for_another_device_keeps_its_host_copies():
    pages, q_lens, kv_lens = [[3, 7], [5]], [2, 1], [6, 3]
    on_cpu = build_page_metadata(pages, q_lens, kv_lens, 4, torch.device("cpu"))
    elsewhere = build_page_metadata(pages, q_lens, kv_lens, 4, torch.device("meta"))
    assert on_cpu.on_host() is on_cpu and elsewhere.qo_indptr.device.type == "meta"
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "positions", "slot_mapping"):
        assert torch.equal(getattr(elsewhere.on_host(), name), getattr(on_cpu, name)), name
    pages = [[3, 7], [5, 6]]
    run_cpu = DecodeSteps(pages, [5, 2], 3, 4, torch.device("cpu"))
    run_elsewhere = DecodeSteps(pages, [5, 2], 3, 4, torch.device("meta"))
    for j in range(3):
        step, host = run_elsewhere.step(j), run_elsewhere.step(j).on_host()
        assert step.kv_lens.device.type == "meta" and host.kv_lens.device.type == "cpu"
        assert torch.equal(host.kv_indptr, run_cpu.step(j).kv_indptr)
        assert torch.equal(host.kv_last_page_len, run_cpu.step(j).kv_last_page_len)
