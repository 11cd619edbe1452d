"""Speculative sampling end to end on stories260K (tests/test_speculative.py holds the greedy, page and seam tests):
the joint distribution of the first (prefill) and second (speculative) token of N requests matches the target's exact
one, computed with transformers' Llama, by a Pearson chi-square; the same statistic against the drafter's
distribution, and against what a verifier resampling rejections from p would give, must fail (the test has power).
Seeded requests reproduce exactly across identical runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from infer.engine import Engine, EngineConfig
from infer.sampling_params import SamplingParams
from tests.test_sampler import ALPHA, reference_probs
from tests.test_speculative import packed_prefill, perturbed_draft_lm, untrained_head  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- sampling ------------------------------------------------------------------------------------------------------

DIST_PROMPT = "She saw a"  # a diverse first token (top probability 0.28) and second token
DIST_N = 3000
DIST_SETTINGS = {"T=1": dict(temperature=1.0), "T=1,top_k=20,top_p=0.9": dict(temperature=1.0, top_k=20, top_p=0.9)}


def pooled_chi_square(counts: Tensor, probs: Tensor) -> tuple[float, float, int]:
    """Pearson chi-square of observed counts against probs, cells with an expected count below 5 pooled into one.

    Returns (statistic, p-value, degrees of freedom); the p-value is chi2(df)'s survival function, the regularised
    upper incomplete gamma Q(df/2, x/2). Counts outside probs' support land in the pooled cell and raise the statistic.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = counts.sum() * probs
    big = expected >= 5
    observed = torch.cat((counts[big], counts[~big].sum()[None]))
    expected = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = expected > 0
    if (observed[~keep] > 0).any():  # mass where the model has none: reject outright
        return math.inf, 0.0, int(keep.sum()) - 1
    observed, expected = observed[keep], expected[keep]
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(expected) - 1), dtype=torch.float64)
    return stat.item(), torch.special.gammaincc(df / 2, stat / 2).item(), int(df)


@torch.no_grad()
def target_conditionals(reference, prompt: list[int], setting: dict) -> tuple[Tensor, Tensor]:
    """Exact ([V] p(t1 | prompt), [V, V] p(t2 | prompt, t1)) from transformers' Llama, every t1 in the vocabulary
    (rows of t1 the target never samples are zero)."""
    vocab = reference.config.vocab_size
    first_logits = reference(torch.tensor([prompt])).logits[0, -1]
    second_logits = reference(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1]
    p1 = reference_probs(first_logits, **sampling_args(setting))
    return p1, filtered_rows(second_logits, setting, p1 > 0)


def filtered_rows(logits: Tensor, setting: dict, rows: Tensor) -> Tensor:
    """[V, V] sampling distributions of the chosen rows of logits (others zero), from the reference implementation."""
    probs = torch.zeros(logits.shape, dtype=torch.float64)
    for t in rows.nonzero().flatten().tolist():
        probs[t] = reference_probs(logits[t], **sampling_args(setting))
    return probs


def sampling_args(setting: dict) -> dict:
    return dict(temperature=setting["temperature"], top_k=setting.get("top_k", 0), top_p=setting.get("top_p", 1.0))


@torch.no_grad()
def drafter_second_token_logits(target, kind: str, drafter, prompt: list[int]) -> Tensor:
    """[V, V] logits the drafter proposes the second token from, for every first token t1."""
    vocab = target.config.vocab_size
    if kind == "draft":  # a draft LM reads prompt + t1 like the target
        return packed_prefill(drafter, [prompt + [t] for t in range(vocab)]).logits
    # An MTP head at position i reads (t_{i+1}, h_i): over the prompt's positions with tokens prompt[1:] + [t1].
    hidden = packed_prefill(target, [prompt]).hidden_states  # [L, H]
    return packed_prefill(drafter, [prompt[1:] + [t] for t in range(vocab)], hidden.repeat(vocab, 1)).logits


@pytest.mark.parametrize("setting", list(DIST_SETTINGS))
@pytest.mark.parametrize("kind,k", [("mtp", 2), ("draft", 1)])
def test_sampled_tokens_follow_the_target(
    stories_model, stories_tokenizer, stories_reference, untrained_head, perturbed_draft_lm, kind, k, setting
):
    """N requests generate 2 tokens each: t1 in the prefill step, t2 in one speculative step where drafts are often
    rejected. Their (t1, t2) counts fit the target's exact joint distribution, and do not fit the drafter's."""
    params = DIST_SETTINGS[setting]
    drafter = untrained_head if kind == "mtp" else perturbed_draft_lm
    prompt = stories_tokenizer.encode(DIST_PROMPT)
    engine = Engine(stories_model, stories_tokenizer, [2], EngineConfig(
        num_draft_tokens=k, backend="torch", page_size=8, num_pages=1024, max_num_seqs=512,
        max_num_batched_tokens=512 * len(prompt),
    ))
    engine.attach_drafter(kind, drafter)
    requests = [engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True, seed=seed, **params))
                for seed in range(DIST_N)]
    while engine.has_unfinished():
        engine.step()

    assert engine.pool.num_free == engine.pool.num_pages
    assert all(len(r.output_ids) == 2 for r in requests)
    assert all(r.spec_stats.verify_steps == 1 for r in requests), "every second token comes from a speculative step"
    rejected_first = engine.spec_stats.accepted_length_histogram[0]
    assert 0.2 * DIST_N < rejected_first < 0.9 * DIST_N, f"draft 1 rejected {rejected_first} times of {DIST_N}"
    vocab = stories_model.config.vocab_size
    pairs = torch.tensor([r.output_ids for r in requests])
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab)

    p1, p2 = target_conditionals(stories_reference, prompt, params)
    q2 = filtered_rows(drafter_second_token_logits(stories_model, kind, drafter, prompt), params, p1 > 0)
    target = p1[:, None] * p2
    # Negative controls: t2 straight from the drafter, and t2 from a verifier that resamples a rejected draft from p
    # instead of the residual max(0, p - q) (accepted mass min(p, q), then p for the rest).
    drafter_joint = p1[:, None] * q2
    overlap = torch.minimum(p2, q2)
    buggy_joint = p1[:, None] * (overlap + (1 - overlap.sum(1, keepdim=True)) * p2)

    stat, pvalue, df = pooled_chi_square(counts, target)
    controls = {name: pooled_chi_square(counts, joint) for name, joint in
                [("drafter", drafter_joint), ("resample-from-p", buggy_joint)]}
    print(f"\n{kind} K={k} {setting}: first draft rejected {rejected_first}/{DIST_N} (expected "
          f"{DIST_N * (1 - (p1[:, None] * overlap).sum().item()):.0f}); target chi2={stat:.1f} "
          f"(df {df}, p={pvalue:.3f}); " + "; ".join(f"{name} chi2={c:.1f} (df {d}, p={pv:.1e})"
                                                       for name, (c, pv, d) in controls.items()))
    assert pvalue > ALPHA, f"(t1, t2) do not follow the target: chi2={stat:.1f}, df={df}, p={pvalue:.2e}"
    # Draft 1 is accepted with probability sum_t1 p(t1) sum_x min(p(x | t1), q(x | t1)): this also checks that q
    # above is what the engine drafted from.
    accept_rate = (p1[:, None] * overlap).sum().item()
    accepted = DIST_N - rejected_first
    z = (accepted - DIST_N * accept_rate) / math.sqrt(DIST_N * accept_rate * (1 - accept_rate))
    assert abs(z) < 4.5, f"draft 1 accepted {accepted}/{DIST_N}, expected rate {accept_rate:.4f} (z={z:.1f})"
    for name, (control, control_pvalue, _) in controls.items():
        assert control_pvalue < ALPHA, f"the statistic cannot tell {name} from the target: chi2={control:.1f}"
    # The second token's marginal alone, the quantity speculation must preserve.
    marginal_stat, marginal_p, _ = pooled_chi_square(torch.bincount(pairs[:, 1], minlength=vocab), target.sum(0))
    assert marginal_p > ALPHA, f"t2 does not follow the target: chi2={marginal_stat:.1f}, p={marginal_p:.2e}"
