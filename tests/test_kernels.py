"""The matrix kernels a verifier's linears run: the same products, each row count through the kernel the machine's
cost table chose for it, every kernel lossless, and the user's model left as it was."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batch import test_batch_rows_equal_batch_one_outputs as batch_property
from test_greedy_lossless import test_greedy_output_equals_model_generate as greedy_property
from torch import nn

import hybrid
from drafters import PromptLookupDrafter
from hybrid.testing import check_greedy_lossless, tiny_model
from schedulers import FixedScheduler, VerifyCostModel
from verifiers import cost_table, kernels
from verifiers import verifier as verifier_module
from verifiers.cost_table import (
    KERNEL_MARGIN,
    CostTable,
    cached_kernel_choice,
    cached_table,
    choose_kernels,
    save_table,
    verify_cost_table,
)
from verifiers.kernels import KERNELS, chosen_kernels, cpu_linears, force_kernel, packed_linear, weight_left_linear

IDS = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])


needs_packed = pytest.mark.skipif("packed" not in KERNELS, reason="this PyTorch has no oneDNN")
KERNEL_LINEARS = [weight_left_linear, pytest.param(packed_linear, marks=needs_packed)]


@pytest.mark.parametrize("kernel", KERNEL_LINEARS, ids=["weight-left", "packed"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (1, 3, 576), (2, 4, 576), (8, 576), (1, 9, 576), (0, 576)])
def test_each_kernel_is_the_linear(kernel, shape, bias):
    layer = nn.Linear(576, 100, bias=bias)
    x = torch.randn(shape)
    out = kernel(layer, x)
    assert out.shape == (*shape[:-1], 100) and out.is_contiguous()
    torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias))


@needs_packed
def test_a_packed_weight_follows_changes_to_the_modules_weight():
    """The reordered copy is the weight's as it is now: changed in place (as `load_state_dict` does), or replaced."""
    layer = nn.Linear(64, 32)
    x = torch.randn(3, 64)
    packed_linear(layer, x)
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    torch.testing.assert_close(packed_linear(layer, x), nn.functional.linear(x, layer.weight, layer.bias))
    layer.load_state_dict(nn.Linear(64, 32).state_dict())
    torch.testing.assert_close(packed_linear(layer, x), nn.functional.linear(x, layer.weight, layer.bias))
    layer.weight = nn.Parameter(torch.randn(32, 64))
    torch.testing.assert_close(packed_linear(layer, x), nn.functional.linear(x, layer.weight, layer.bias))


def _behind_the_version_counter(layer: nn.Linear, change: str) -> None:
    """Change `layer`'s weight as code that goes around autograd does, leaving `weight._version` as it was."""
    if change == "data-in-place":  # PEFT's LoRA merge: weight.data += delta
        layer.weight.data += 0.5 * torch.randn_like(layer.weight)
    elif change == "data-replaced":  # PEFT's safe merge, DeepSpeed and FSDP: weight.data = other
        layer.weight.data = torch.randn_like(layer.weight)
    elif change == "dtype-round-trip":  # model.half().float(): the weight rounded, in new memory
        layer.half()
        layer.float()
    elif change == "one-row":  # one output's weights edited in place (a new token's row of an LM head)
        layer.weight.data[7] *= -10.0
    else:
        raise ValueError(change)


CHANGES_BEHIND_THE_VERSION_COUNTER = ["data-in-place", "data-replaced", "dtype-round-trip", "one-row"]


@needs_packed
@pytest.mark.parametrize("change", CHANGES_BEHIND_THE_VERSION_COUNTER)
def test_a_weight_changed_behind_its_version_counter_is_reordered_again_by_the_next_call(change):
    """`.data` (and numpy) writes leave a tensor's version counter as it was: a call starts by forgetting every
    reordered copy whose weight has other memory or other values in its rows (`forget_changed_weights`)."""
    layer = nn.Linear(64, 32)
    x = torch.randn(3, 64)
    packed_linear(layer, x)
    version = layer.weight._version
    _behind_the_version_counter(layer, change)
    assert layer.weight._version == version
    kernels.forget_changed_weights([layer])
    torch.testing.assert_close(packed_linear(layer, x), nn.functional.linear(x, layer.weight, layer.bias))


@needs_packed
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])  # gpt2: a head tied to the input embedding
@pytest.mark.parametrize("change", ["data-in-place", "data-replaced", "one-row"])  # a round trip keeps its argmaxes
def test_generate_after_a_weight_changed_behind_its_version_counter_equals_model_generate(
    arch, change, tmp_path, monkeypatch
):
    """A user who merges a LoRA into the verifier between two calls gets the merged model's output from the second."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model(arch, 64, 2, seed=0)
    save_table(model, CostTable(dict.fromkeys(range(1, 10), 1.0), dict.fromkeys(range(1, 10), "packed")))
    before = model.generate(IDS, max_new_tokens=12, do_sample=False)
    assert torch.equal(hybrid.generate(model, IDS, drafter=PromptLookupDrafter(), max_new_tokens=12), before)
    head = model.get_output_embeddings()
    assert head in kernels._PACKED  # the call reordered the head's weight
    _behind_the_version_counter(head, change)
    after = model.generate(IDS, max_new_tokens=12, do_sample=False)
    assert not torch.equal(after, before)  # the change matters to the output
    assert torch.equal(hybrid.generate(model, IDS, drafter=PromptLookupDrafter(), max_new_tokens=12), after)


@needs_packed
def test_a_call_frees_the_reordered_copies_of_weights_no_longer_float32(tmp_path, monkeypatch):
    """`model.half()` after a call: the next call keeps no float32 copy of what is now a float16 weight."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 2, seed=0)
    save_table(model, CostTable(dict.fromkeys(range(1, 10), 1.0), dict.fromkeys(range(1, 10), "packed")))
    hybrid.generate(model, IDS, drafter=None, max_new_tokens=4)
    assert model.lm_head in kernels._PACKED
    model.half()
    hybrid.generate(model, IDS, drafter=None, max_new_tokens=4)
    assert not any(module in kernels._PACKED for module in model.modules())


def rows_seen(kernel: str = "weight-left"):
    """A spy on one kernel: the row counts it computed, in order."""
    name = {"weight-left": "weight_left_linear", "packed": "packed_linear"}[kernel]
    real, seen = getattr(kernels, name), []

    def spy(module, x):
        seen.append(x.numel() // x.shape[-1])
        return real(module, x)

    return seen, mock.patch.object(kernels, name, spy)


def test_each_row_count_runs_its_chosen_kernel():
    layer = nn.Linear(8, 8)
    seen, spy = rows_seen()
    with spy, chosen_kernels([layer], {2: "weight-left", 4: "weight-left", 5: "torch"}):
        for rows in (1, 2, 3, 4, 5):
            layer(torch.randn(rows, 8))
    assert seen == [2, 4]
    with spy, force_kernel("weight-left"), chosen_kernels([layer], {}):
        layer(torch.randn(1, 8)), layer(torch.randn(7, 8))
    assert seen == [2, 4, 1, 7]
    with spy, force_kernel("torch"), chosen_kernels([layer], {2: "weight-left"}):
        layer(torch.randn(2, 8))
        assert "forward" not in vars(layer)  # PyTorch's own forward, untouched
    assert seen == [2, 4, 1, 7]
    with pytest.raises(ValueError, match="kernel 'mkl' is not one of"), force_kernel("mkl"):
        pass


@needs_packed
def test_row_counts_of_one_block_run_different_kernels():
    layer = nn.Linear(8, 8)
    (left, left_spy), (packed, packed_spy) = rows_seen("weight-left"), rows_seen("packed")
    with left_spy, packed_spy, chosen_kernels([layer], {2: "weight-left", 4: "packed", 6: "packed"}):
        for rows in (1, 2, 3, 4, 6):
            out = layer(x := torch.randn(rows, 8))
            torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias))
    assert left == [2] and packed == [4, 6]


def test_only_linears_whose_product_is_reproduced_are_routed():
    class Quantised(nn.Linear):
        pass

    class LinearOnlyWeight(torch.Tensor):
        """A weight that serves F.linear and no other product, as torchao's quantised weights do."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is not nn.functional.linear and func.__name__ in ("mm", "matmul", "addmm"):
                raise NotImplementedError(f"{func.__name__} of a quantised weight")
            return super().__torch_function__(func, types, args, kwargs or {})

    wrapped = nn.Linear(4, 4)
    wrapped.forward = lambda x: x  # a wrapper put on the instance (as accelerate's hooks do)
    subclassed = nn.Linear(4, 4)
    subclassed.weight = nn.Parameter(subclassed.weight.detach().as_subclass(LinearOnlyWeight))
    model = nn.Sequential(
        nn.Linear(4, 4), Quantised(4, 4), nn.Linear(4, 4).to(torch.bfloat16), wrapped, subclassed, nn.ReLU()
    )
    assert cpu_linears(model) == [model[0]]
    x = torch.randn(2, 4)
    with force_kernel("weight-left"), chosen_kernels(cpu_linears(model), {2: "weight-left"}):
        torch.testing.assert_close(subclassed(x), nn.functional.linear(x, subclassed.weight, subclassed.bias))


def test_the_block_leaves_the_modules_as_they_were_and_nests():
    layer = nn.Linear(4, 4)
    rows = {2: "weight-left"}
    with chosen_kernels([layer], rows):
        assert "forward" in vars(layer)
        with chosen_kernels([layer], rows):
            pass
        assert "forward" in vars(layer)  # the outer block still uses it
    assert "forward" not in vars(layer)
    with pytest.raises(RuntimeError), chosen_kernels([layer], rows):
        raise RuntimeError("a failing forward")
    assert "forward" not in vars(layer)


def test_a_block_of_a_known_row_count_pytorch_serves_installs_nothing():
    layer = nn.Linear(4, 4)
    with chosen_kernels([layer], {2: "weight-left"}, rows=1):
        assert "forward" not in vars(layer)  # PyTorch's own product, as without the block
    with chosen_kernels([layer], {2: "torch"}, rows=2):
        assert "forward" not in vars(layer)
    with chosen_kernels([layer], {2: "weight-left"}, rows=2):
        assert "forward" in vars(layer)
    with force_kernel("weight-left"), chosen_kernels([layer], {2: "weight-left"}, rows=1):
        assert "forward" in vars(layer)  # forced: every row count
    assert "forward" not in vars(layer)


def test_a_forward_the_user_sets_during_the_block_is_kept():
    layer = nn.Linear(4, 4)
    with chosen_kernels([layer], {2: "weight-left"}):
        layer.forward = own = lambda x: x
    assert vars(layer)["forward"] is own


def test_concurrent_blocks_leave_the_modules_as_they_were():
    layer = nn.Linear(8, 8)
    x = torch.randn(3, 8)
    errors = []

    def work():
        for _ in range(200):
            with chosen_kernels([layer], {3: "weight-left"}):
                if not torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6):
                    errors.append("wrong product")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and "forward" not in vars(layer)


def test_another_thread_outside_a_block_gets_pytorchs_own_product():
    layer = nn.Linear(64, 64)
    x = torch.randn(3, 64)
    seen, spy = rows_seen()
    outside = []
    with spy, force_kernel("weight-left"), chosen_kernels([layer], {3: "weight-left"}):
        thread = threading.Thread(target=lambda: outside.append(layer(x)))
        thread.start()
        thread.join()
        layer(x)
    assert seen == [3]  # this thread's call only
    assert torch.equal(outside[0], nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("kernel", KERNELS)
def test_generate_leaves_the_users_model_unchanged(kernel):
    model = tiny_model("llama", 64, 2, seed=0)
    mlp = model.model.layers[0].mlp
    calls, hooked = [], []
    mlp.down_proj.forward = own = lambda x: calls.append(x.shape) or nn.Linear.forward(mlp.down_proj, x)
    handle = mlp.up_proj.register_forward_hook(lambda module, args, out: hooked.append(out.shape))
    plain = model.generate(IDS, max_new_tokens=12, do_sample=False)
    calls.clear(), hooked.clear()
    with force_kernel(kernel):
        out = hybrid.generate(model, IDS, drafter=PromptLookupDrafter(), max_new_tokens=12, do_sample=False)
    assert torch.equal(out, plain)
    assert len(calls) == len(hooked) > 1  # the user's forward and hook ran in every forward
    assert vars(mlp.down_proj)["forward"] is own and mlp.up_proj._forward_hooks
    assert not any("forward" in vars(m) for m in model.modules() if m is not mlp.down_proj)
    handle.remove()


KERNEL_PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("prop", [greedy_property, batch_property], ids=["greedy", "batch"])
def test_greedy_properties_hold_under_each_kernel(kernel, prop):
    with force_kernel(kernel):
        KERNEL_PROPERTY(given(data=st.data())(prop.hypothesis.inner_test))()


def test_a_width_gets_the_faster_kernel_and_pytorchs_within_the_margin():
    slower = 1 - KERNEL_MARGIN / 2
    curves = {"torch": {1: 1.0, 2: 2.0, 4: 2.0, 8: 1.0}, "weight-left": {1: 1.2, 2: 1.0, 4: 2.0 * slower, 8: 0.5}}
    costs, chosen = choose_kernels(curves)
    assert chosen == {1: "torch", 2: "weight-left", 4: "torch", 8: "weight-left"}
    assert costs == {1: 1.0, 2: 1.0, 4: 2.0, 8: 0.5}
    assert all(costs[m] <= curves["torch"][m] for m in costs)  # never more than PyTorch's own forward
    assert choose_kernels({"torch": {1: 1.0}}) == ({1: 1.0}, {1: "torch"})


def test_the_cost_table_exposes_the_kernel_of_every_width():
    table = CostTable(
        {1: 1.0, 2: 1.0, 4: 1.0, 8: 2.0, 12: 2.0, 16: 3.0},
        {2: "weight-left", 4: "weight-left", 8: "packed", 12: "packed", 16: "weight-left"},
    )
    assert [table.kernel(m) for m in range(1, 18)] == [
        "torch",
        *["weight-left"] * 3,
        *["torch"] * 3,  # between two kernels: PyTorch's own
        *["packed"] * 5,
        *["torch"] * 3,
        "weight-left",
        "torch",
    ]
    assert table.row_kernels() == {
        **dict.fromkeys([2, 3, 4, 16], "weight-left"),
        **dict.fromkeys(range(8, 13), "packed"),
    }
    assert CostTable({1: 1.0, 5: 2.0}).row_kernels() == {}  # no choice given: PyTorch's


def test_the_choice_is_cached_with_the_cost_table_and_read_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 1, seed=0)
    curves = {"torch": {1: 1.0, 2: 2.0, 3: 2.0}, "weight-left": {1: 1.0, 2: 1.0, 3: 3.0}}
    monkeypatch.setattr(cost_table, "measure_verify_costs", lambda model: curves)
    assert cached_kernel_choice(model)[0] == {}  # nothing cached: PyTorch's kernels, nothing measured
    measured = verify_cost_table(model)
    assert measured.kernels == {1: "torch", 2: "weight-left", 3: "torch"}
    monkeypatch.setattr(cost_table, "measure_verify_costs", mock.Mock(side_effect=AssertionError("measured again")))
    cached = verify_cost_table(model)
    assert cached.kernels == measured.kernels and cached.costs == measured.costs
    assert VerifyCostModel.for_model(model).table == list(cached.costs.values())  # the scheduler's curve: the same
    assert cached_kernel_choice(model)[0] == {2: "weight-left"}
    (tmp_path / "costs" / f"{cost_table.device_key(model)}.json").write_text('{"1": 0.1}')  # not a table
    assert cached_table(model) is None


def test_a_cached_table_is_not_read_on_another_kind_of_cpu(tmp_path, monkeypatch):
    """A cache folder carried to a CPU of another model or other vector extensions measures again: the kernel that
    wins on one may double a verify on the other."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 1, seed=0)
    monkeypatch.setattr(cost_table, "cpu_name", lambda: "Xeon avx2 fma")
    save_table(model, CostTable({1: 1.0, 2: 1.0}, {2: "weight-left"}))
    assert cached_table(model) is not None
    monkeypatch.setattr(cost_table, "cpu_name", lambda: "Xeon amx_tile avx2 avx512f fma")
    assert cached_table(model) is None


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_plain_step_runs_the_kernel_chosen_for_its_batch_width(batch, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 1, seed=0)
    save_table(model, CostTable({1: 1.0, 2: 1.0, 3: 2.0}, {2: "weight-left"}))
    monkeypatch.setattr(cost_table, "measure_verify_costs", mock.Mock(side_effect=AssertionError("measured")))
    seen, spy = rows_seen()
    ids = IDS.expand(batch, -1)
    with spy:
        out = hybrid.generate(model, ids, drafter=None, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))
    assert set(seen) == ({2} if batch == 2 else set())


def test_verify_costs_prints_both_curves_and_each_widths_kernel(capsys, tmp_path, monkeypatch):
    from experiments import verify_costs

    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    monkeypatch.setattr(verify_costs, "PROBE_SIZES", (1, 2, 9))  # a full table at these sizes: it is cached
    result = verify_costs.main(["--model", "tiny", "--rounds", "1", "--sizes", "1,2,9"])
    assert set(result) == {*KERNELS, "chosen"} and all(set(c) == {1, 2, 9} for c in result.values())
    assert all(0 < s < float("inf") for kernel in KERNELS for s in result[kernel].values())
    table = capsys.readouterr().out
    assert "| 2 |" in table and "weight-left (ms)" in table and "cached" in table
    assert all(f" {result['chosen'][m]} |" in table for m in (1, 2, 9))
    assert list(tmp_path.glob("costs/*.json"))
    with pytest.raises(SystemExit):
        verify_costs.main(["--model", "tiny", "--rounds", "0"])


def test_a_verify_is_padded_by_a_position_only_where_the_table_says_that_is_cheaper():
    from verifiers.verifier import cheaper_width

    costs = {1: 2.0, 2: 1.0, 3: 1.5, 4: 1.6, 6: 1.0}
    assert [cheaper_width(m, 1, costs) for m in (1, 2, 3, 5)] == [2, 2, 3, 5]  # 5: no cost of 5 or 6 fed tokens
    assert cheaper_width(3, 2, costs) == 3  # 2 rows x 3 = 6 fed, 2 x 4 = 8 not measured
    assert cheaper_width(1, 3, costs) == 2 and cheaper_width(2, 2, costs) == 3  # 3 -> 6 and 4 -> 6 fed tokens
    assert cheaper_width(1, 1, {1: 1.0, 2: 0.97}) == 1  # within the margin: not padded
    assert cheaper_width(1, 1, {}) == 1


def every_forward_padded():
    """hybrid.generate told by the machine's table that one more position per row always costs less."""
    return mock.patch(
        "hybrid.generate.cached_kernel_choice",
        lambda model: (cached_kernel_choice(model)[0], {n: 1.0 / n for n in range(1, 400)}),
    )


def test_a_padded_one_token_step_feeds_two_positions_and_gives_generates_output():
    model = tiny_model("llama", 48, 2, seed=3)
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    with every_forward_padded():
        out = hybrid.generate(model, IDS, drafter=None, max_new_tokens=12, do_sample=False)
    hook.remove()
    assert widths[0] == IDS.shape[1] and set(widths[1:]) == {2}  # the prefill, then each step padded to 2
    assert torch.equal(out, model.generate(IDS, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("prop", [greedy_property, batch_property], ids=["greedy", "batch"])
def test_greedy_properties_hold_with_every_verify_padded(prop):
    with every_forward_padded():
        KERNEL_PROPERTY(given(data=st.data())(prop.hypothesis.inner_test))()


def test_a_call_installs_its_kernels_once_and_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    """Installing the dispatch around each forward costs milliseconds on a real model: a call installs it once."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 2, seed=0)
    save_table(model, CostTable({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, {3: "weight-left", 4: "weight-left"}))
    monkeypatch.setattr(cost_table, "measure_verify_costs", mock.Mock(side_effect=AssertionError("measured")))
    blocks, real = [], verifier_module.chosen_kernels
    monkeypatch.setattr(verifier_module, "chosen_kernels", lambda *a, **k: blocks.append(a[1]) or real(*a, **k))
    seen, spy = rows_seen()
    with spy:
        out = hybrid.generate(
            model, IDS, drafter=PromptLookupDrafter(), scheduler=FixedScheduler(2), max_new_tokens=12, do_sample=False
        )
    assert torch.equal(out, model.generate(IDS, max_new_tokens=12, do_sample=False))
    assert blocks == [{3: "weight-left", 4: "weight-left"}] and 3 in seen and set(seen) <= {3, 4}
    assert not any("forward" in vars(m) for m in model.modules())


@needs_packed
def test_the_packed_weights_are_made_before_a_call_needs_them(tmp_path, monkeypatch):
    """The first forward a packed kernel serves would otherwise reorder every weight (0.2 s on the real verifier)."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 2, seed=0)
    linears = cpu_linears(model)
    cost_table.prepare_kernels(model)  # nothing cached: nothing to make
    assert not any(module in kernels._PACKED for module in linears)
    save_table(model, CostTable({1: 1.0, 2: 1.0, 9: 1.0}, {9: "packed"}))
    cost_table.prepare_kernels(model)
    made = [kernels.packed_weight(module) for module in linears]
    assert all(kernels.packed_weight(module) is weight for module, weight in zip(linears, made))  # not made again
    kernels._PACKED.clear()
    out = hybrid.generate(model, IDS, drafter=None, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, model.generate(IDS, max_new_tokens=4, do_sample=False))
    assert all(module in kernels._PACKED for module in linears)  # made on entering the call, though no step ran 9 rows


def test_the_packed_kernel_is_a_candidate_only_where_it_runs(monkeypatch):
    """A PyTorch without oneDNN, or whose oneDNN has no float32 inner product here, never probes it."""
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not kernels._packed_runs()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    failing = mock.Mock(side_effect=RuntimeError("could not create a primitive descriptor"))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", failing, raising=False)
    assert not kernels._packed_runs()


@pytest.mark.parametrize("kernel", [pytest.param("packed", marks=needs_packed), "weight-left"])
def test_under_cpu_autocast_every_product_is_pytorchs_as_in_generate(kernel, tmp_path, monkeypatch):
    """The kernel choice was measured for float32, and the packed kernel fails on the bfloat16 activations autocast
    gives it. So a call under autocast runs PyTorch's products, as `generate` does, and its output is `generate`'s
    under the same autocast, up to a near tie in autocast's dtype."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 2, seed=0)
    save_table(model, CostTable(dict.fromkeys(range(1, 18), 1.0), dict.fromkeys(range(1, 18), kernel)))
    seen, spy = rows_seen(kernel)
    with spy, torch.autocast("cpu", dtype=torch.bfloat16):
        check_greedy_lossless(model, IDS, PromptLookupDrafter(), max_new_tokens=12)
    assert not seen


def test_the_cost_probe_under_autocast_measures_the_models_own_products(tmp_path, monkeypatch):
    """The first call that needs the cost table measures it; under autocast it measures with autocast off (the table
    is cached for the model's dtype and every kernel is timed as it runs outside autocast)."""
    monkeypatch.setenv("HYBRID_COSTS", str(tmp_path / "costs"))
    model = tiny_model("llama", 64, 2, seed=0)
    autocast_seen = []
    real = cost_table._measure_verify_costs

    def measure(*args, **kwargs):
        autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_table, "_measure_verify_costs", measure)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_greedy_lossless(model, IDS, PromptLookupDrafter(), max_new_tokens=12)
    assert autocast_seen == [False] and cached_table(model) is not None
