"""`speculative_decode` alone: a function of a target forward, a drafter and the requests, returning the emitted tokens.

Both models here are Markov chains over a small vocabulary (the next token's logits depend on the current token
only), so the target's greedy continuation and its exact distribution over a continuation are known in closed form:
- Greedy: the emitted tokens are the target's greedy continuation of the pending token, as many as the drafts
  matched it plus one, for K = 1..4, with drafts often right and often wrong.
- Sampling: requests generate 3 tokens each through repeated rounds; the joint counts of those tokens fit the target
  chain's exact distribution by a Pearson chi-square over many requests. Broken drafters, which report other
  probabilities than those they drew their drafts from, must fail the same statistic (the test has power).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor

from infer.sampler import SamplingTensors, make_generator, sample, target_probs
from infer.sampling_params import SamplingParams
from infer.speculative import speculative_decode
from tests.test_sampler import ALPHA, chi_square


@dataclass
class FakeRequest:
    """What speculative_decode reads of a request: its tokens, the last one pending."""

    request_id: int
    token_ids: list[int]
    num_computed: int = 0
    page_table: None = None


@dataclass
class MarkovTarget:
    """The target forward: each verify row's logits are the chain's row for that row's token."""

    logits: Tensor  # [V, V] row t: the logits of the token after t
    calls: list[Tensor] = field(default_factory=list)

    def __call__(self, verify_ids: Tensor) -> Tensor:  # [B, K+1] -> [B*(K+1), V]
        self.calls.append(verify_ids)
        return self.logits[verify_ids.flatten()]


@dataclass
class MarkovDrafter:
    """Drafts from its own chain, as `infer.speculative.Drafter.draft` does: a probability row and a sample per
    draft (one generator draw each), the next draft read from the last. `reported` replaces the probabilities it
    hands back (a broken drafter)."""

    logits: Tensor  # [V, V]
    reported: Tensor | None = None  # [V, V] logits

    def draft(self, requests, k: int, sampling: SamplingTensors, generators) -> tuple[Tensor, Tensor | None]:
        token = torch.tensor([r.token_ids[-1] for r in requests])
        tokens, probs = [], []
        for _ in range(k):
            logits = self.logits[token]
            if not sampling.all_greedy:
                shown = logits if self.reported is None else self.reported[token]
                probs.append(target_probs(shown, sampling.temperature, sampling.top_k, sampling.top_p))
            token = sample(logits, sampling, generators)
            tokens.append(token)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)


def greedy_chain(logits: Tensor, start: int, length: int) -> list[int]:
    chain = [start]
    for _ in range(length):
        chain.append(int(logits[chain[-1]].argmax()))
    return chain[1:]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_emits_the_targets_greedy_continuation(k):
    vocab, batch = 40, 400
    gen = torch.Generator().manual_seed(k)
    target_logits = torch.randn(vocab, vocab, generator=gen)
    # the drafter agrees with the target's argmax on about half the tokens
    draft_logits = target_logits + 0.3 * torch.randn(vocab, vocab, generator=gen)
    target, drafter = MarkovTarget(target_logits), MarkovDrafter(draft_logits)
    requests = [FakeRequest(b, [int(t)]) for b, t in enumerate(torch.randint(vocab, (batch,), generator=gen))]
    greedy = SamplingTensors.from_params([SamplingParams()] * batch, "cpu")

    emitted, num_emitted = speculative_decode(target, drafter, requests, k, greedy, [torch.Generator()] * batch)

    assert emitted.shape == (batch, k + 1) and num_emitted.shape == (batch,)
    (verify_ids,) = target.calls  # one target forward: the pending token, then the K drafts
    assert verify_ids[:, 0].tolist() == [r.token_ids[-1] for r in requests]
    for b, request in enumerate(requests):
        n = int(num_emitted[b])
        want = greedy_chain(target_logits, request.token_ids[-1], k + 1)
        drafts = verify_ids[b, 1:].tolist()
        matched = next((j for j in range(k) if drafts[j] != want[j]), k)
        assert n == matched + 1
        assert emitted[b].tolist() == want[:n] + [-1] * (k + 1 - n)
    counts = torch.bincount(num_emitted, minlength=k + 2).tolist()
    assert counts[1] > batch // 10 and counts[k + 1] > batch // 50, f"a weak check: emitted counts {counts}"


# The chains of the sampling test: 5 tokens, rows of P with zeros where the drafter's Q has mass and back.
P = torch.tensor([
    [.40, .30, .20, .10, .00],
    [.10, .20, .00, .30, .40],
    [.25, .25, .25, .00, .25],
    [.00, .50, .10, .20, .20],
    [.30, .00, .30, .30, .10],
], dtype=torch.float64)  # fmt: skip
Q = torch.tensor([
    [.20, .20, .20, .20, .20],
    [.40, .10, .30, .20, .00],
    [.10, .50, .10, .30, .00],
    [.30, .30, .00, .20, .20],
    [.30, .20, .20, .20, .10],
], dtype=torch.float64)  # fmt: skip
START, LENGTH, TRIALS = 0, 3, 10_000


def log_probs(probs: Tensor) -> Tensor:
    return probs.float().log()  # log 0 = -inf: the token is never drawn


def generated_counts(drafter: MarkovDrafter, k: int) -> Tensor:
    """[V ** LENGTH] how often each continuation of START came out, over TRIALS seeded requests, each stepped through
    speculative_decode rounds (all in one batch) until it holds LENGTH tokens."""
    target = MarkovTarget(log_probs(P))
    requests = [FakeRequest(i, [START]) for i in range(TRIALS)]
    generators = [make_generator(i, "cpu") for i in range(TRIALS)]
    params = SamplingParams(temperature=1.0)
    live = list(range(TRIALS))
    while live:
        batch = [requests[i] for i in live]
        sampling = SamplingTensors.from_params([params] * len(batch), "cpu")
        emitted, num_emitted = speculative_decode(target, drafter, batch, k, sampling, [generators[i] for i in live])
        for request, row, n in zip(batch, emitted.tolist(), num_emitted.tolist()):
            assert all(t >= 0 for t in row[:n]) and all(t == -1 for t in row[n:])
            request.token_ids.extend(row[:n])
        live = [i for i in live if len(requests[i].token_ids) <= LENGTH]
    vocab = P.shape[0]
    index = torch.zeros(TRIALS, dtype=torch.long)
    for position in range(1, LENGTH + 1):
        index = index * vocab + torch.tensor([r.token_ids[position] for r in requests])
    return torch.bincount(index, minlength=vocab ** LENGTH)


def chain_probs(probs: Tensor) -> Tensor:
    """[V ** LENGTH] the exact probability of each continuation of START under the chain `probs`."""
    joint = probs[START]
    for _ in range(LENGTH - 1):  # the flat index's last digit is the last token
        joint = (joint[:, None] * probs[torch.arange(len(joint)) % probs.shape[0]]).flatten()
    return joint


@pytest.mark.parametrize("k", [1, 3])
def test_sampled_tokens_follow_the_target_chain_and_a_broken_drafter_fails(k):
    target_chain = chain_probs(P)
    assert target_chain.sum().item() == pytest.approx(1.0)

    counts = generated_counts(MarkovDrafter(log_probs(Q)), k)
    stat, pvalue = chi_square(counts, target_chain)
    assert int(counts[target_chain == 0].sum()) == 0, "a continuation the target never produces came out"
    assert pvalue > ALPHA, f"the tokens do not follow the target: chi2={stat:.1f}, p={pvalue:.2e}"

    # Broken drafters, whose reported q is not the one their drafts were drawn from: one reports the target's
    # probabilities (every draft is accepted: the tokens follow its own chain), one tempers its q unlike its draws
    # (T=0.7 against 1), the bug of a draft side processed unlike the target's.
    for name, reported in [("reports p", log_probs(P)), ("tempered q", log_probs(Q) / 0.7)]:
        broken = generated_counts(MarkovDrafter(log_probs(Q), reported=reported), k)
        broken_stat, broken_pvalue = chi_square(broken, target_chain)
        assert broken_pvalue < ALPHA, f"the statistic cannot tell the broken drafter ({name}): chi2={broken_stat:.1f}"
