"""Speculative verification: greedy prefix matching, and rejection sampling that provably preserves the target.

The statistical tests run 10^5 verifications of fixed synthetic p and q and compare the emitted tokens with p by
Pearson chi-square. Three deliberately broken verifiers, run through the same statistic, must fail: they show the
test would catch those bugs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from infer.rejection_sampler import greedy_verify, rejection_sample
from infer.sampler import make_generator
from tests.test_sampler import ALPHA, chi_square

N = 100_000
K = 2
# Synthetic vocabulary of 12 with every case the acceptance test must handle: q > p (1, 4), q = p (2, 8, 11),
# q = 0 < p (3, 6), p = 0 < q (5, 7), p = q = 0 (9). Rows: positions 0..K; q has no row K.
# fmt: off
P = torch.tensor([
    [.25, .15, .10, .10, .08, .00, .07, .00, .05, .00, .10, .10],
    [.05, .05, .30, .00, .20, .10, .00, .10, .00, .05, .15, .00],
    [.02, .08, .10, .20, .00, .15, .05, .10, .10, .10, .05, .05],
], dtype=torch.float64)
Q = torch.tensor([
    [.10, .25, .10, .00, .15, .10, .00, .12, .05, .00, .03, .10],
    [.20, .05, .10, .10, .25, .00, .05, .00, .15, .05, .05, .00],
], dtype=torch.float64)
# fmt: on
VOCAB = P.shape[1]
ACCEPT_RATE = torch.minimum(P[:K], Q).sum(-1)  # [K] analytic P(accept draft j | drafts before it accepted)

Verifier = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (drafts, q, p) -> (tokens, num_emitted)


def draw_drafts(seed: int) -> Tensor:
    """[N, K] drafts, column j drawn from Q[j]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(Q[j], N, replacement=True, generator=gen) for j in range(K)], dim=1)


def production(seed: int) -> Verifier:
    """rejection_sample with its own generator per row, as the engine calls it."""

    def verify(drafts: Tensor, q: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        generators = [make_generator(seed + row, "cpu") for row in range(len(drafts))]
        return rejection_sample(drafts, q.float(), p.float(), generators)

    return verify


def reference(seed: int, *, accept: str = "p/q", residual: str = "normalised") -> Verifier:
    """Batched textbook verifier on one shared stream, sampling by inverse CDF, with optional bugs:
    accept="q/p" accepts with min(1, q/p); residual="unnormalised" feeds max(0, p - q) to the inverse CDF without
    dividing by its mass; residual="p" resamples from p instead of the residual."""

    def verify(drafts: Tensor, q: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        batch, k = drafts.shape
        p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
        q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
        ratio = p_draft / q_draft if accept == "p/q" else q_draft / p_draft  # x / 0 = inf: always accepted
        accepted = torch.rand(batch, k, generator=gen, dtype=torch.float64) < ratio
        num_accepted = accepted.long().cumprod(-1).sum(-1)
        rows = torch.arange(batch)
        p_next = p[rows, num_accepted]
        q_next = torch.where((num_accepted < k)[:, None], q[rows, num_accepted.clamp(max=k - 1)], 0.0)
        weights = p_next if residual == "p" else (p_next - q_next).clamp_min(0.0)
        if residual == "normalised":
            weights = weights / weights.sum(-1, keepdim=True)
        u = torch.rand(batch, 1, generator=gen, dtype=torch.float64)
        next_token = torch.searchsorted(weights.cumsum(-1), u, right=True).clamp(max=p.shape[-1] - 1).squeeze(1)
        tokens = torch.cat([drafts, torch.full((batch, 1), -1)], dim=1)
        tokens[torch.arange(k + 1) >= num_accepted[:, None]] = -1
        tokens[rows, num_accepted] = next_token
        return tokens, num_accepted + 1

    return verify


def run(verifier: Verifier, draft_seed: int = 0) -> tuple[Tensor, Tensor]:
    drafts = draw_drafts(draft_seed)
    return verifier(drafts, Q.expand(N, K, VOCAB), P.expand(N, K + 1, VOCAB))


def position_fit(tokens: Tensor, num_emitted: Tensor, position: int) -> tuple[float, float, int]:
    """(chi2, p-value, draws outside the support) of the token at `position` against P[position], over the rows
    that reached it, i.e. whose drafts before it were all accepted."""
    counts = torch.bincount(tokens[num_emitted > position, position], minlength=VOCAB)
    return *chi_square(counts, P[position]), int(counts[P[position] == 0].sum())


def binomial_z(successes: int, trials: int, rate: float) -> float:
    return (successes - trials * rate) / math.sqrt(trials * rate * (1 - rate))


# --- greedy_verify ---------------------------------------------------------------------------------------------------


def test_greedy_verify_hand_made_cases() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    target_argmax = torch.tensor([
        [5, 6, 7, 9],  # all accepted: bonus 9
        [5, 8, 7, 9],  # second rejected; the later match (7) must not count
        [5, 6, 0, 9],  # last rejected
        [5, 6, 7, 9],  # first rejected
    ])  # fmt: skip

    tokens, num_emitted = greedy_verify(drafts, target_argmax)

    assert tokens.tolist() == [[5, 6, 7, 9], [5, 8, -1, -1], [5, 6, 0, -1], [5, -1, -1, -1]]
    assert num_emitted.tolist() == [4, 2, 3, 1]
    assert tokens.dtype == num_emitted.dtype == torch.long


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_verify_matches_row_loop(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    # A 3-token vocabulary makes every prefix length common.
    drafts = torch.randint(0, 3, (200, k), generator=gen)
    target_argmax = torch.randint(0, 3, (200, k + 1), generator=gen)

    tokens, num_emitted = greedy_verify(drafts, target_argmax)

    for row in range(200):
        emitted = []
        for j in range(k + 1):
            emitted.append(target_argmax[row, j].item())
            if j == k or drafts[row, j] != target_argmax[row, j]:
                break
        assert num_emitted[row].item() == len(emitted)
        assert tokens[row].tolist() == emitted + [-1] * (k + 1 - len(emitted))
    assert set(num_emitted.tolist()) == set(range(1, k + 2))


# --- rejection_sample: exact cases and conventions ---------------------------------------------------------------


def test_rejection_sample_deterministic_cases() -> None:
    """One-hot p and q make every decision certain: agreement accepts and adds p_K's bonus; p(x) = 0 rejects and
    the correction is the residual's only token."""
    one_hot = torch.eye(5)
    drafts = torch.tensor([[1, 2], [1, 2], [3, 2]])
    q = one_hot[drafts]  # [3, 2, 5]
    p = torch.stack([one_hot[[1, 2, 4]], one_hot[[1, 0, 4]], one_hot[[0, 2, 4]]])  # [3, 3, 5]
    generators = [make_generator(row, "cpu") for row in range(3)]

    tokens, num_emitted = rejection_sample(drafts, q, p, generators)

    assert tokens.tolist() == [[1, 2, 4], [1, 0, -1], [0, -1, -1]]
    assert num_emitted.tolist() == [3, 2, 1]


def test_rejection_sample_reproducible_per_row_and_consumes_documented_draws() -> None:
    """Row 0 alone and inside a batch of 4 (other rows with other seeds and inputs) emits the same tokens, and each
    row's generator advances by exactly torch.rand(K) then exponential_ over V."""
    k, vocab = 4, 50
    gen = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(4, k, vocab, generator=gen), -1)
    p = torch.softmax(torch.randn(4, k + 1, vocab, generator=gen), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(4, k)

    for trial in range(20):
        alone = rejection_sample(drafts[:1], q[:1], p[:1], [make_generator(trial, "cpu")])
        batch_generators = [make_generator(trial, "cpu")] + [make_generator(1000 + r, "cpu") for r in range(3)]
        batched = rejection_sample(drafts, q, p, batch_generators)
        assert torch.equal(alone[0][0], batched[0][0]) and alone[1][0] == batched[1][0]

        replay = make_generator(trial, "cpu")
        torch.rand(k, generator=replay)
        torch.empty(vocab).exponential_(generator=replay)
        assert torch.equal(batch_generators[0].get_state(), replay.get_state())


# --- rejection_sample: distribution ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["production", "reference"])
def verified(request: pytest.FixtureRequest) -> tuple[Tensor, Tensor]:
    """(tokens, num_emitted) of N verifications, shared by the tests below; the reference checks the harness."""
    return run(production(seed=20) if request.param == "production" else reference(seed=20))


def test_emission_conventions(verified: tuple[Tensor, Tensor]) -> None:
    tokens, num_emitted = verified

    assert tokens.shape == (N, K + 1) and tokens.dtype == num_emitted.dtype == torch.long
    assert num_emitted.min() >= 1 and num_emitted.max() <= K + 1
    within = torch.arange(K + 1) < num_emitted[:, None]
    assert (tokens[within] >= 0).all() and (tokens[within] < VOCAB).all()
    assert (tokens[~within] == -1).all()
    drafts = draw_drafts(0)
    accepted = torch.arange(K) < (num_emitted - 1)[:, None]
    assert torch.equal(tokens[:, :K][accepted], drafts[accepted])  # accepted drafts are emitted unchanged


def test_emitted_tokens_follow_target(verified: tuple[Tensor, Tensor]) -> None:
    """Position 0 ~ p_0 over all rows; position 1 ~ p_1 given draft 0 accepted; the bonus ~ p_2 given both
    accepted. Acceptance rates per position match sum_x min(p_j(x), q_j(x)) within 4.5 binomial sigmas."""
    tokens, num_emitted = verified

    for position in range(K + 1):
        stat, pvalue, leaked = position_fit(tokens, num_emitted, position)
        assert leaked == 0, f"position {position} emitted {leaked} tokens with p = 0"
        assert pvalue > ALPHA, f"position {position}: chi2={stat:.1f}, p={pvalue:.2e}"

    for j in range(K):
        trials, accepted = int((num_emitted > j).sum()), int((num_emitted > j + 1).sum())
        z = binomial_z(accepted, trials, ACCEPT_RATE[j].item())
        assert abs(z) < 4.5, f"draft {j}: acceptance {accepted / trials:.4f} vs {ACCEPT_RATE[j]:.4f} (z={z:.1f})"


@pytest.mark.parametrize(
    "mutation", [{"accept": "q/p"}, {"residual": "unnormalised"}, {"residual": "p"}], ids=lambda m: str(m)
)
def test_statistic_rejects_broken_verifiers(mutation: dict[str, str]) -> None:
    """Negative controls: the chi-square on the first token alone (support leaks aside) must reject each bug."""
    stat, pvalue, _ = position_fit(*run(reference(seed=20, **mutation)), position=0)
    assert pvalue < ALPHA, f"{mutation} went undetected: chi2={stat:.1f}, p={pvalue:.2e}"
