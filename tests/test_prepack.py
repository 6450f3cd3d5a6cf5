"""bf16 linear layers from a prepacked oneDNN weight (`dcoco.nn.prepack`): same outputs as
`nn.Linear`, a packed copy that follows the weight, plain autograd, and the Target's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import tiny_model

from dcoco.nn.prepack import PrepackedLinear, prepack_enabled, prepack_linears, prepack_supported
from dcoco.target import Target

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="needs oneDNN with bf16 support on this CPU")


def packed_pair(bias: bool, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed.load_state_dict(plain.state_dict())
    assert prepack_linears(packed) == 1
    return plain, packed


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (2, 3, 96), (64, 96)])
def test_prepacked_linear_matches_linear(bias, shape):
    plain, packed = packed_pair(bias)
    assert isinstance(packed, PrepackedLinear) and packed.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = packed(x), plain(x)
    assert packed._packed is not None  # the packed kernel ran
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_packed_copy_follows_the_weight():
    plain, packed = packed_pair(bias=True)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        packed(x)
    first = packed._packed
    for m in (plain, packed):  # an optimizer step changes the weights in place
        m.weight.grad = torch.ones_like(m.weight)
        m.bias.grad = torch.ones_like(m.bias)
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    with torch.no_grad():
        torch.testing.assert_close(packed(x), plain(x))
        assert packed._packed is not first
        again = packed._packed
        packed(x)
        assert packed._packed is again  # unchanged weight: no repacking
        w = torch.randn_like(plain.weight)
        plain.weight, packed.weight = nn.Parameter(w), nn.Parameter(w.clone())  # replaced outright
        torch.testing.assert_close(packed(x), plain(x))
        packed.load_state_dict(plain.state_dict() | {"weight": -plain.weight})
        torch.testing.assert_close(packed(x), nn.functional.linear(x, -plain.weight, plain.bias))


def test_autograd_and_other_dtypes_take_the_plain_path():
    plain, packed = packed_pair(bias=True)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    packed(x).float().sum().backward()
    plain(x).float().sum().backward()
    assert packed._packed is None  # training never packs
    torch.testing.assert_close(packed.weight.grad, plain.weight.grad)
    xr = x.clone().requires_grad_()
    packed.weight.requires_grad_(False)
    packed(xr).float().sum().backward()  # gradients to the input (a frozen target head under a drafter)
    assert xr.grad is not None and packed._packed is None
    f32 = nn.Linear(96, 8)
    assert prepack_linears(f32) == 0 and type(f32) is nn.Linear


def test_target_prepacks_its_bf16_linears_on_cpu(monkeypatch):
    model = tiny_model().to(torch.bfloat16)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    plain = tiny_model().to(torch.bfloat16)
    Target(model)
    assert prepack_enabled() and sum(isinstance(m, PrepackedLinear) for m in model.modules()) == n_linear
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)
    f32 = tiny_model()
    Target(f32)
    assert not any(isinstance(m, PrepackedLinear) for m in f32.modules())
    monkeypatch.setenv("DCOCO_PREPACK", "0")
    off = tiny_model().to(torch.bfloat16)
    Target(off)
    assert not prepack_enabled() and not any(isinstance(m, PrepackedLinear) for m in off.modules())


def test_trained_drafters_prepack_their_bf16_linears(tmp_path, monkeypatch):
    """A bf16 drafter loaded by `load_drafter` has its linears and draft-vocabulary head packed as the target's:
    same hidden states and draft logits as the plain layers."""
    from dcoco.drafters.dflash import BlockDrafter, DFlashConfig, DFlashModel, save_dflash
    from dcoco.speculative import SpeculativeConfig, load_drafter

    target = Target(tiny_model().to(torch.bfloat16))
    torch.manual_seed(0)
    model = DFlashModel(DFlashConfig.for_target(target, num_layers=1, block_size=4, num_features=2))
    model.set_draft_vocab(torch.arange(0, target.vocab_size, 3))
    save_dflash(tmp_path, model)
    drafter = load_drafter(SpeculativeConfig(method="dflash", model=str(tmp_path)), target)
    linears = [m for m in drafter.model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) > 5 and all(isinstance(m, PrepackedLinear) for m in linears)
    assert isinstance(drafter.draft_head, PrepackedLinear)
    monkeypatch.setenv("DCOCO_PREPACK", "0")
    plain = BlockDrafter(model.to(torch.bfloat16), target)
    assert type(plain.draft_head) is nn.Linear and not any(isinstance(m, PrepackedLinear) for m in model.modules())
    H, n = model.cfg.hidden_size, len(model.cfg.target_layer_ids)
    feats, emb = torch.randn(1, 7, n * H, dtype=torch.bfloat16), torch.randn(1, 4, H, dtype=torch.bfloat16)
    ctx_pos, pos = torch.arange(7).unsqueeze(0), torch.arange(6, 10).unsqueeze(0)
    with torch.no_grad():
        got = drafter.model(emb, pos, drafter.model.context_kv(feats, ctx_pos), None)
        want = model(emb, pos, model.context_kv(feats, ctx_pos), None)
        assert any(m._packed is not None for m in linears)  # the packed kernels ran
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(drafter.draft_logits(got[:, 1:]), plain.draft_logits(got[:, 1:]))
