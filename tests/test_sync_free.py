"""The sampling and verification a step launches read nothing back to the host: each runs under
torch.compile(fullgraph=True), where a host read (.item(), .tolist(), bool(tensor)) or a data-dependent shape fails
the compile; a control with such a read fails it, so the check can fail."""

from __future__ import annotations

import pytest
import torch

from infer.rejection_sampler import greedy_verify, rejection_accept
from infer.sampler import SamplingTensors, sample_with, target_probs
from infer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fullgraph(fn):
    """fn compiled as one graph (dynamo only: the eager backend needs no C++ compiler)."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.2)]
    st = SamplingTensors.from_params(params, "cpu")
    logits = torch.randn(4, 64, generator=gen) * 3
    exponentials = torch.empty(4, 64).exponential_(generator=gen)
    return st, logits, exponentials, gen


def test_sampling_compiles_as_one_graph_and_a_host_read_does_not(batch):
    st, logits, exponentials, _ = batch
    args = (logits, st.greedy, st.temperature, st.top_k, st.top_p, exponentials, st.filtering)
    assert torch.equal(fullgraph(sample_with)(*args), sample_with(*args))
    # the control: target_probs left to find out on the device whether any row filters reads it back
    with pytest.raises(Exception, match="(?i)data.dependent"):
        fullgraph(target_probs)(logits, st.temperature, st.top_k, st.top_p)


def test_verification_compiles_as_one_graph(batch):
    st, _, exponentials, gen = batch
    k, vocab = 3, 64
    drafts = torch.randint(0, vocab, (4, k), generator=gen)
    q = torch.softmax(torch.randn(4, k, vocab, generator=gen), -1)
    p = torch.softmax(torch.randn(4, k + 1, vocab, generator=gen), -1)
    uniforms = torch.rand(4, k, generator=gen)
    cases = ((rejection_accept, (drafts, q, p, uniforms, exponentials)), (greedy_verify, (drafts, p.argmax(-1))))
    for fn, args in cases:
        compiled, eager = fullgraph(fn)(*args), fn(*args)
        assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    # the control: a verifier that asks the host whether any draft matched before verifying
    def asks_first(d: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not bool((d == t[:, :-1]).any()):
            return t[:, :1], torch.ones_like(t[:, 0])
        return greedy_verify(d, t)

    with pytest.raises(Exception, match="(?i)data.dependent"):
        fullgraph(asks_first)(drafts, p.argmax(-1))
