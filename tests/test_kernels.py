"""The few-row CPU kernels a verify runs its linears through: the same products, and the model left as it was."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import hybrid
from drafters import PromptLookupDrafter
from hybrid.testing import tiny_model
from verifiers.kernels import NARROW_ROWS, cpu_linears, narrow_linear, narrow_linears


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (1, 3, 576), (2, 4, 576), (8, 576), (1, 9, 576), (0, 576)])
def test_narrow_linear_is_the_linear(shape, bias):
    layer = nn.Linear(576, 100, bias=bias)
    x = torch.randn(shape)
    out = narrow_linear(layer, x)
    assert out.shape == (*shape[:-1], 100) and out.is_contiguous()
    torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias))


def test_narrow_rows_are_the_few_row_products():
    assert 1 not in NARROW_ROWS and all(m in NARROW_ROWS for m in range(2, 9))


def test_only_plain_float32_cpu_linears_are_routed():
    class Quantised(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Quantised(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.ReLU())
    assert cpu_linears(model) == [model[0]]


def test_the_block_leaves_the_modules_as_they_were_and_nests():
    layer = nn.Linear(4, 4)
    with narrow_linears([layer]):
        assert "forward" in vars(layer)
        with narrow_linears([layer]):
            pass
        assert "forward" in vars(layer)  # the outer block still uses it
    assert "forward" not in vars(layer)
    with pytest.raises(RuntimeError), narrow_linears([layer]):
        raise RuntimeError("a failing forward")
    assert "forward" not in vars(layer)


def test_concurrent_blocks_leave_the_modules_as_they_were():
    layer = nn.Linear(8, 8)
    x = torch.randn(3, 8)
    errors = []

    def work():
        for _ in range(200):
            with narrow_linears([layer]):
                if not torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6):
                    errors.append("wrong product")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and "forward" not in vars(layer)


def test_generate_leaves_the_users_model_unchanged():
    model = tiny_model("llama", 64, 2, seed=0)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    out = hybrid.generate(model, ids, drafter=PromptLookupDrafter(), max_new_tokens=12, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=12, do_sample=False))
    assert not any("forward" in vars(m) for m in model.modules())


def test_verify_costs_prints_both_curves(capsys):
    from experiments import verify_costs

    best = verify_costs.main(["--model", "tiny", "--rounds", "1", "--sizes", "1,2,9"])
    assert set(best) == {"torch", "hybrid"} and all(set(c) == {1, 2, 9} for c in best.values())
    assert all(0 < s < float("inf") for c in best.values() for s in c.values())
    table = capsys.readouterr().out
    assert "| 2 |" in table and "hybrid's" in table
    with pytest.raises(SystemExit):
        verify_costs.main(["--model", "tiny", "--rounds", "0"])
