"""Sampling math: parameter checks, filtering against an independent reference, and draw frequencies."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from infer.sampler import SamplingTensors, make_generator, sample, target_probs
from infer.sampling_params import SamplingParams

# Per-test false-alarm rate of a chi-square test if the seeds were changed; the fixed seeds make each run identical.
ALPHA = 1e-4


def chi_square(counts: Tensor, probs: Tensor) -> tuple[float, float]:
    """Pearson statistic of observed counts against probs over probs' support, and its p-value.

    Expected counts use the total number of draws, so mass that leaked outside the support also raises the
    statistic; callers check separately that zero-probability tokens were never drawn. The survival function of
    chi2(df) is the regularised upper incomplete gamma Q(df/2, x/2), which torch provides (no scipy needed).
    """
    counts, probs = counts.double(), probs.double()
    support = probs > 0
    expected = counts.sum() * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = torch.tensor(support.sum().item() - 1, dtype=torch.float64)
    return stat.item(), torch.special.gammaincc(df / 2, stat / 2).item()


def reference_probs(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """One row, float64, written from the definition with Python loops: softmax(logits / T), keep the top_k largest
    (ties: lower id first), then the shortest most-likely-first prefix with mass >= top_p, renormalise."""
    scaled = (logits.double() / temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    if top_k > 0:
        order = order[:top_k]
    peak = max(scaled[i] for i in order)
    weight = {i: math.exp(scaled[i] - peak) for i in order}
    total = sum(weight.values())
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += weight[i] / total
        if top_p < 1.0 and mass >= top_p:
            break
    probs = torch.zeros(len(scaled), dtype=torch.float64)
    for i in kept:
        probs[i] = weight[i]
    return probs / probs.sum()


def batch_tensors(temperature: list[float], top_k: list[int], top_p: list[float]) -> tuple[Tensor, Tensor, Tensor]:
    return torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p)


# --- SamplingParams -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 101.0),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("top_k", 33),  # > vocab_size
        ("max_new_tokens", 0),
        ("seed", -1),
        ("stop", ("",)),
        ("stop", "</s>"),  # a bare string would be split into characters
        ("stop", (7,)),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", (32,)),  # >= vocab_size
    ],
)
def test_validate_rejects_bad_value_naming_it(field: str, value: object) -> None:
    params = SamplingParams(**{"temperature": 0.8, field: value})
    with pytest.raises(ValueError, match=field):
        params.validate(vocab_size=32)


def test_validate_accepts_boundaries() -> None:
    for params in [
        SamplingParams(),
        SamplingParams(temperature=100.0, top_k=32, top_p=1.0, max_new_tokens=1, seed=0),
        SamplingParams(temperature=1e-3, top_k=-1, top_p=1e-6, stop=("\n\n",), stop_token_ids=(0, 31)),
    ]:
        params.validate(vocab_size=32)
    SamplingParams(top_k=10**6).validate()  # vocab unknown: no upper bound on top_k


def test_greedy_means_zero_temperature() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5, top_k=1).greedy


# --- target_probs ------------------------------------------------------------------------------------------------


def test_target_probs_matches_reference() -> None:
    """Each row zeroes exactly the tokens the reference drops and matches its renormalised values."""
    gen = torch.Generator().manual_seed(0)
    settings = [  # (temperature, top_k, top_p)
        (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0),
        (1.0, 1, 1.0), (1.0, 5, 1.0), (0.7, 31, 1.0), (1.0, 32, 1.0),
        (1.0, 0, 0.9), (0.6, 0, 0.5), (1.5, 0, 1e-4),
        (0.8, 10, 0.8), (1.2, 3, 0.99), (1.0, 20, 0.3),
        (4.0, 8, 0.6), (8.0, 16, 0.5),  # flat: top-p must act on the top-k-renormalised distribution
    ]  # fmt: skip
    logits = 3 * torch.randn(len(settings), 32, generator=gen)
    temperature, top_k, top_p = batch_tensors(*map(list, zip(*settings)))

    probs = target_probs(logits, temperature, top_k, top_p)

    assert probs.dtype == torch.float32
    for row, (t, k, p) in enumerate(settings):
        expected = reference_probs(logits[row], t, k, p)
        assert torch.equal(probs[row] > 0, expected > 0), f"row {row}: kept set differs"
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(settings)))


def test_filters_off_are_noops() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen)
    temperature = torch.tensor([1.0, 0.5, 2.0])
    plain = torch.softmax(logits / temperature[:, None], dim=-1)

    off = target_probs(logits, temperature, torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert torch.equal(off, plain)
    # The same rows inside a batch whose last row filters (so the sorted path runs), and top_k = V.
    mixed = target_probs(logits, temperature, torch.tensor([0, 50, 4]), torch.tensor([1.0, 1.0, 0.5]))
    torch.testing.assert_close(mixed[:2], plain[:2], atol=1e-7, rtol=1e-6)


def test_top_k_one_and_tiny_top_p_are_one_hot_at_argmax() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 40, generator=gen)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
    temperature = torch.full((6,), 1.3)

    by_k = target_probs(logits, temperature, torch.ones(6, dtype=torch.long), torch.ones(6))
    by_p = target_probs(logits, temperature, torch.zeros(6, dtype=torch.long), torch.full((6,), 1e-6))

    assert torch.equal(by_k, one_hot)
    assert torch.equal(by_p, one_hot)


def test_top_k_ties_keep_lower_token_ids() -> None:
    small = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 0.0]])
    probs = target_probs(small, torch.ones(1), torch.tensor([2]), torch.ones(1))
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1, 3]
    torch.testing.assert_close(probs[0, [1, 3]], torch.tensor([0.5, 0.5]))

    large = torch.zeros(1, 4096)
    large[0, ::3] = 1.0  # 1366 tokens tied at the top; an unstable sort keeps an arbitrary 8 of them
    probs = target_probs(large, torch.ones(1), torch.tensor([8]), torch.ones(1))
    assert (probs[0] > 0).nonzero().flatten().tolist() == list(range(0, 24, 3))


def test_greedy_rows_are_one_hot_in_sampling_tensors() -> None:
    """Greedy rows reach target_probs as a one-hot at the argmax, so speculative verification of a mixed batch can
    use target_probs for every row."""
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(top_k=5, top_p=0.5)]
    st = SamplingTensors.from_params(params, "cpu")
    assert st.greedy.tolist() == [True, False, True] and not st.all_greedy
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.long and st.top_p.dtype == torch.float32
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))

    probs = target_probs(logits, st.temperature, st.top_k, st.top_p)

    for row in (0, 2):
        assert torch.equal(probs[row], torch.nn.functional.one_hot(logits[row].argmax(), 20).float())
    assert (probs[1] > 0).sum() > 1


def test_from_params_maps_disabled_top_k_to_zero() -> None:
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=-1)], "cpu")
    assert st.top_k.tolist() == [0] and st.top_p.tolist() == [1.0] and st.temperature.tolist() == [1.0]


# --- sample ------------------------------------------------------------------------------------------------------


def test_greedy_rows_sample_argmax() -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    greedy = SamplingTensors.from_params([SamplingParams()] * 5, "cpu")
    generators = [make_generator(i, "cpu") for i in range(5)]
    assert torch.equal(sample(logits, greedy, generators), logits.argmax(-1))

    mixed = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=1.0)] * 2 + [SamplingParams()], "cpu")
    tokens = sample(logits, mixed, generators)
    assert torch.equal(tokens[[0, 2, 4]], logits.argmax(-1)[[0, 2, 4]])

    top_k_one = SamplingTensors.from_params([SamplingParams(temperature=2.0, top_k=1)] * 5, "cpu")
    assert torch.equal(sample(logits, top_k_one, generators), logits.argmax(-1))


def test_sample_frequencies_match_reference_probs() -> None:
    """25k draws per setting; the expected counts come from the independent reference, not from target_probs."""
    vocab, draws = 16, 25_000
    settings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.5, top_k=8, top_p=0.9)]  # fmt: skip
    logits = torch.randn(len(settings), vocab, generator=torch.Generator().manual_seed(5))
    st = SamplingTensors.from_params([p for p in settings for _ in range(draws)], "cpu")
    shared = make_generator(6, "cpu")  # one stream for all rows keeps this fast; per-row streams are tested below

    tokens = sample(logits.repeat_interleave(draws, 0), st, [shared] * (len(settings) * draws))

    for i, params in enumerate(settings):
        expected = reference_probs(logits[i], params.temperature, params.top_k, params.top_p)
        counts = torch.bincount(tokens[i * draws : (i + 1) * draws], minlength=vocab)
        assert counts[expected == 0].sum() == 0, f"setting {i} drew a filtered token"
        stat, pvalue = chi_square(counts, expected)
        assert pvalue > ALPHA, f"setting {i}: chi2={stat:.1f}, p={pvalue:.2e}"


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    """A request's tokens depend only on its own seed and logits, not on its batch position or neighbours."""
    vocab, steps = 100, 20
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(steps, 4, vocab, generator=gen)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=42), SamplingParams(temperature=1.0, top_k=7, seed=1),
              SamplingParams(), SamplingParams(temperature=1.5, seed=9)]  # fmt: skip
    st_alone = SamplingTensors.from_params(params[:1], "cpu")
    st_batch = SamplingTensors.from_params(params, "cpu")

    def run(batched: bool) -> list[int]:
        generators = [make_generator(p.seed, "cpu") for p in params]
        rows = slice(None) if batched else slice(0, 1)
        st = st_batch if batched else st_alone
        return [sample(logits[s, rows], st, generators[rows])[0].item() for s in range(steps)]

    alone = run(batched=False)
    assert alone == run(batched=False)
    assert alone == run(batched=True)
    assert len(set(alone)) > 1  # really sampling, not stuck on one token


def test_generator_consumption() -> None:
    """Each row draws exactly V exponentials per call (documented order); an all-greedy batch draws nothing."""
    vocab = 30
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(8))
    generators = [make_generator(10, "cpu"), make_generator(11, "cpu")]
    sample(logits, SamplingTensors.from_params([SamplingParams(temperature=1.0), SamplingParams()], "cpu"), generators)
    for seed, generator in zip((10, 11), generators):
        replay = make_generator(seed, "cpu")
        torch.empty(vocab).exponential_(generator=replay)
        assert torch.equal(generator.get_state(), replay.get_state())

    untouched = make_generator(12, "cpu")
    sample(logits[:1], SamplingTensors.from_params([SamplingParams()], "cpu"), [untouched])
    assert torch.equal(untouched.get_state(), make_generator(12, "cpu").get_state())


def test_make_generator_seeding() -> None:
    assert torch.equal(make_generator(5, "cpu").get_state(), torch.Generator().manual_seed(5).get_state())
    torch.manual_seed(0)
    first = make_generator(None, "cpu").get_state()
    torch.manual_seed(0)
    assert torch.equal(make_generator(None, "cpu").get_state(), first)
    assert not torch.equal(make_generator(None, "cpu").get_state(), first)
