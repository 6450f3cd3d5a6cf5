import pytest
import torch

from dcoco import InvalidSamplingParamsError, SamplingParams
from dcoco.sampling import probabilities


def test_temperature_topk_topp():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    p = probabilities(logits, 1.0)
    assert torch.allclose(p, torch.softmax(logits, -1))
    pk = probabilities(logits, 1.0, top_k=2)
    assert (pk[0, 2:] == 0).all() and torch.allclose(pk.sum(), torch.tensor(1.0))
    assert torch.allclose(pk[0, :2], torch.softmax(logits[0, :2], -1))
    # top-p: smallest set whose mass reaches p, computed by hand
    sm = torch.softmax(logits, -1)[0]
    pp = probabilities(logits, 1.0, top_p=float(sm[0] + sm[1]) - 1e-4)
    assert (pp[0, 2:] == 0).all() and (pp[0, :2] > 0).all()
    pp1 = probabilities(logits, 1.0, top_p=float(sm[0]) * 0.5)
    assert pp1[0, 0] == 1.0
    cold = probabilities(logits, 0.5)
    assert torch.allclose(cold, torch.softmax(logits / 0.5, -1))


def test_topk_keeps_ties():
    p = probabilities(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 1.0, top_k=2)
    assert torch.allclose(p[0, :3], torch.full((3,), 1 / 3))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(stop=[""]),
        dict(temperature=float("nan")),
        dict(foo=1),
    ],
)
def test_invalid_params(kwargs):
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**kwargs)


def test_aliases():
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
