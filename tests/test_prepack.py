"""bf16 and float32 linear layers from a prepacked oneDNN weight (`dcoco.nn.prepack`): same outputs
as `nn.Linear`, a packed copy that follows the weight, plain autograd, and the Target's use of it.
Each test runs for every dtype this CPU packs (float32 wherever oneDNN is, bf16 with AVX-512)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import tiny_model

from dcoco.nn.prepack import PACKED_DTYPES, PrepackedLinear, prepack_enabled, prepack_linears, prepack_supported
from dcoco.target import Target

DTYPES = [
    pytest.param(d, marks=pytest.mark.skipif(not prepack_supported(d), reason=f"oneDNN has no {d} path on this CPU"))
    for d in PACKED_DTYPES
]


def packed_pair(bias: bool, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(96, 160, bias=bias).to(dtype)
    packed = nn.Linear(96, 160, bias=bias).to(dtype)
    packed.load_state_dict(plain.state_dict())
    assert prepack_linears(packed) == 1
    return plain, packed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (2, 3, 96), (64, 96)])
def test_prepacked_linear_matches_linear(bias, shape, dtype):
    plain, packed = packed_pair(bias, dtype)
    assert isinstance(packed, PrepackedLinear) and packed.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(shape, dtype=dtype)
    with torch.no_grad():
        got, want = packed(x), plain(x)
    assert packed._packed is not None  # the packed kernel ran
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_copy_follows_the_weight(dtype):
    plain, packed = packed_pair(True, dtype)
    x = torch.randn(4, 96, dtype=dtype)
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_and_other_dtypes_take_the_plain_path(dtype):
    plain, packed = packed_pair(True, dtype)
    x = torch.randn(3, 96, dtype=dtype)
    packed(x).float().sum().backward()
    plain(x).float().sum().backward()
    assert packed._packed is None  # training never packs
    torch.testing.assert_close(packed.weight.grad, plain.weight.grad)
    xr = x.clone().requires_grad_()
    packed.weight.requires_grad_(False)
    packed(xr).float().sum().backward()  # gradients to the input (a frozen target head under a drafter)
    assert xr.grad is not None and packed._packed is None
    f16 = nn.Linear(96, 8).to(torch.float16)
    assert prepack_linears(f16) == 0 and type(f16) is nn.Linear


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """Each row's product comes out the same whether it is multiplied alone or among others, so a
    verification pass scores its tokens as decoding one at a time does (on the CPUs where oneDNN's
    kernels are blocked that way; a failure here says speculative greedy output may drift)."""
    _, packed = packed_pair(False, dtype)
    x = torch.randn(33, 96, dtype=dtype)
    with torch.no_grad():
        full = packed(x)
        for n in (1, 2, 3, 5, 8, 16):
            assert torch.equal(packed(x[:n]), full[:n]), n


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_prepacks_its_linears_on_cpu(monkeypatch, dtype):
    model = tiny_model().to(dtype)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    plain = tiny_model().to(dtype)
    Target(model)
    assert prepack_enabled(dtype) and sum(isinstance(m, PrepackedLinear) for m in model.modules()) == n_linear
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)
    f16 = tiny_model().to(torch.float16)
    Target(f16)
    assert not any(isinstance(m, PrepackedLinear) for m in f16.modules())
    monkeypatch.setenv("DCOCO_PREPACK", "0")
    off = tiny_model().to(dtype)
    Target(off)
    assert not prepack_enabled(dtype) and not any(isinstance(m, PrepackedLinear) for m in off.modules())


@pytest.mark.parametrize("dtype", DTYPES)
def test_trained_drafters_prepack_their_linears(tmp_path, monkeypatch, dtype):
    """A drafter loaded by `load_drafter` has its linears and draft-vocabulary head packed as the target's:
    same hidden states and draft logits as the plain layers."""
    from dcoco.drafters.dflash import BlockDrafter, DFlashConfig, DFlashModel, save_dflash
    from dcoco.speculative import SpeculativeConfig, load_drafter

    target = Target(tiny_model().to(dtype))
    torch.manual_seed(0)
    model = DFlashModel(DFlashConfig.for_target(target, num_layers=1, block_size=4, num_features=2))
    model.set_draft_vocab(torch.arange(0, target.vocab_size, 3))
    save_dflash(tmp_path, model)
    drafter = load_drafter(SpeculativeConfig(method="dflash", model=str(tmp_path)), target)
    linears = [m for m in drafter.model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) > 5 and all(isinstance(m, PrepackedLinear) for m in linears)
    assert isinstance(drafter.draft_head, PrepackedLinear)
    monkeypatch.setenv("DCOCO_PREPACK", "0")
    model.load_state_dict(drafter.model.state_dict())  # the checkpoint's (bf16-rounded) weights
    plain = BlockDrafter(model.to(dtype), target)
    assert type(plain.draft_head) is nn.Linear and not any(isinstance(m, PrepackedLinear) for m in model.modules())
    H, n = model.cfg.hidden_size, len(model.cfg.target_layer_ids)
    feats, emb = torch.randn(1, 7, n * H, dtype=dtype), torch.randn(1, 4, H, dtype=dtype)
    ctx_pos, pos = torch.arange(7).unsqueeze(0), torch.arange(6, 10).unsqueeze(0)
    with torch.no_grad():
        got = drafter.model(emb, pos, drafter.model.context_kv(feats, ctx_pos), None)
        want = model(emb, pos, model.context_kv(feats, ctx_pos), None)
        assert any(m._packed is not None for m in linears)  # the packed kernels ran
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(drafter.draft_logits(got[:, 1:]), plain.draft_logits(got[:, 1:]))
