"""The matrix kernel each plain float32 CPU `nn.Linear` of the verifier runs, chosen per number of rows.

A forward of m fed tokens over b rows multiplies every weight by a [b * m, in] input. PyTorch computes that as
x @ W.T. Two other forms compute the same product: (W @ x.T).T ("weight-left"), which streams the weights once, as
the one-row kernel does, and oneDNN's inner product on a copy of the weight reordered once into its blocked layout
("packed"), which skips the per-call packing PyTorch's kernel does for a few rows. Which is fastest depends on the
CPU, its BLAS and the row count: on one 2-core Xeon the weight-left form halves a verify of 2-8 rows and doubles it
on another, where the packed form runs a verify of 7-15 rows 6-18% faster and one of 1-3 about 30% slower. So
nothing here decides: `verifiers.cost_table` times a forward of every width with each kernel on the user's machine,
once, and caches the choice with the cost table; a `Verifier` runs each row count through the kernel measured
fastest there (`chosen_kernels`) and leaves every other product to PyTorch. `force_kernel` pins one kernel for every
row count (the cost probe measures each candidate through it, and tests run the losslessness properties under each).

The packed form keeps its reordered copy of each weight it has served (as much memory again as those weights)
for as long as the module lives, and makes a new one when the weight is replaced or changed in place: through its
own ops (its version counter) at any forward, and through `.data` where a call starts (`forget_changed_weights`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _packed_runs() -> bool:
    """Whether this PyTorch computes a float32 product through oneDNN on a reordered weight: some builds have no
    oneDNN, and some CPUs' oneDNN no float32 inner product."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(8, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8), packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 8), 8.0)))


# PyTorch's own x @ W.T, (W @ x.T).T, and oneDNN's product with a reordered weight where this PyTorch runs it.
KERNELS = ("torch", "weight-left", *(("packed",) if _packed_runs() else ()))
# The row count oneDNN is told to reorder a weight for: one layout serves every row count, and on the Xeon measured
# one reordered for many rows runs a few rows faster than one reordered for those few.
PACKED_FOR_ROWS = 64

# What the linear forwards installed by `chosen_kernels` compute in this thread; outside a block (another thread
# calling the same model, e.g. the user's own `model.generate`) they compute PyTorch's product.
_ROW_KERNELS: contextvars.ContextVar[Mapping[int, str]] = contextvars.ContextVar(
    "row_kernels", default=types.MappingProxyType({})
)
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("forced_kernel", default=None)


def weight_left_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` computed as (W @ x.T).T."""
    rows = _rows(x)
    out = torch.mm(module.weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if module.bias is not None:
        out += module.bias
    return out.view(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class _Reordered:
    """A weight's reordered copy, and what tells whether the weight is still what it was made from: the same
    parameter at the same in-place version (ops on the weight count, writes through `.data` do not), its elements at
    the same address (`weight.data = other` moves them; memory freed since and handed to a later `.data` at that
    address shows in `rows`, unless it holds the same bits there), the same shape and dtype (`model.half()` keeps the
    parameter), and the same bits in one element of each row (`_row_sample`)."""

    weight: torch.Tensor
    version: int
    address: int
    form: tuple
    rows: torch.Tensor
    packed: torch.Tensor


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> _Reordered


def packed_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` through oneDNN's inner product on a reordered copy of the weight (`packed_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(module), module.bias, "none", [], "")


def packed_weight(module: nn.Linear) -> torch.Tensor:
    """The module's weight reordered for oneDNN: made on first use (a few ms per million weights) and again whenever
    the module's weight is another tensor or was changed in place since. A change its version counter does not
    count (a write through `.data`) is caught where a call starts (`forget_changed_weights`)."""
    weight = module.weight
    entry = _PACKED.get(module)
    if entry is None or entry.weight is not weight or entry.version != weight._version:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
        form = (weight.shape, weight.dtype)
        entry = _Reordered(weight, weight._version, weight.data_ptr(), form, _row_sample(weight).clone(), packed)
        _PACKED[module] = entry
    return entry.packed


def forget_changed_weights(modules) -> None:
    """Forget the reordered copy of each of `modules` whose weight changed behind its version counter: code that
    writes through `.data` (PEFT merging a LoRA, `weight.data = other`, `model.half().float()`, a row edited in
    place) leaves the counter as it was. Such a weight has other memory, or other bits in some row's sampled
    element; a change that leaves every sampled element as it was (a few elements edited through `.data`) goes
    unseen. A call runs this as it starts (`Verifier.kernels`): 3-5 ms for SmolLM2-135M's 211 linears on a 2-core
    CPU, where reading every element would cost about a forward."""
    for module in modules:
        entry = _PACKED.get(module)
        if entry is None:
            continue
        weight = module.weight
        moved = weight.data_ptr() != entry.address or (weight.shape, weight.dtype) != entry.form
        if moved or not torch.equal(_row_sample(weight), entry.rows):
            del _PACKED[module]


def _row_sample(weight: torch.Tensor) -> torch.Tensor:
    """The bits of every (in - 1)-th element of `weight` [out, in]: one or two in every row, their column moving
    along from row to row, so a row, or all of the weight, changed in place shows (a read of 0.2 M elements for
    SmolLM2-135M's 211 linears)."""
    flat = weight.detach().reshape(-1)  # a view of a contiguous weight
    return flat[:: max(1, weight.shape[-1] - 1)].view(_BITS[weight.element_size()])


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits, by its size


def prepare_linears(linears: list[nn.Linear], kernels) -> None:
    """Make now what the given kernels will need, so that no forward pays for it: the packed kernel's reordered
    weights (0.2 s for SmolLM2-135M on a 2-core CPU)."""
    if "packed" in kernels:
        for module in linears:
            packed_weight(module)


def _chosen_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    kernel = _FORCED.get() or _ROW_KERNELS.get().get(_rows(x), "torch")
    if kernel == "weight-left" and x.shape[-1]:
        return weight_left_linear(module, x)
    if kernel == "packed" and x.shape[-1]:
        return packed_linear(module, x)
    return F.linear(x, module.weight, module.bias)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def cpu_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's linears whose product a kernel choice can reproduce exactly: plain float32 `nn.Linear`s on a
    CPU. Subclasses (quantised or parametrised ones), linears whose weight is a tensor subclass (torchao's
    quantised weights) and modules carrying their own `forward` (a wrapper put on the instance, as accelerate's
    offloading hooks do) keep what they compute. Forward hooks run either way."""
    return [
        m
        for m in model.modules()
        if type(m) is nn.Linear
        and type(m.weight) is nn.Parameter
        and "forward" not in vars(m)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
    ]


@contextlib.contextmanager
def force_kernel(kernel: str):
    """Within the block, every `chosen_kernels` block of this thread runs `kernel` at every row count."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    token = _FORCED.set(kernel)
    try:
        yield
    finally:
        _FORCED.reset(token)


# module -> [blocks (threads) using it now, the forward they installed]; the last one out removes it.
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


@contextlib.contextmanager
def chosen_kernels(linears: list[nn.Linear], row_kernels: dict[int, str], rows: int | None = None):
    """Within the block, `linears` compute a product of r rows through `row_kernels[r]` (all of them through the
    kernel of `force_kernel`) and the rest through PyTorch. Afterwards every module is as it was: a module that
    has gained its own `forward` meanwhile is left alone, and concurrent blocks on one model nest.

    `rows`: the row count of the block's dense products, when the caller knows it (a forward of every fed position).
    Where PyTorch's kernel serves it, nothing is installed: installing and removing a forward on each of a model's
    hundreds of linears costs milliseconds, a few percent of a CPU step.

    Under CPU autocast every product is PyTorch's, as in `generate`: the choice was measured for the model's own
    dtype, and the packed kernel fails on the bfloat16 activations autocast gives it."""
    forced = _FORCED.get()
    row_kernels = {r: kernel for r, kernel in row_kernels.items() if kernel != "torch"}
    if (
        forced == "torch"
        or (forced is None and (not row_kernels or rows is not None and rows not in row_kernels))
        or torch.is_autocast_enabled("cpu")
    ):
        yield  # nothing to change: PyTorch's own forward
        return
    token = _ROW_KERNELS.set(row_kernels)
    with _LOCK:
        used = [module for module in linears if module in _USERS or "forward" not in vars(module)]
        for module in used:
            if module not in _USERS:
                installed = types.MethodType(_chosen_linear, module)
                module.forward = installed
                _USERS[module] = [0, installed]
            _USERS[module][0] += 1
    try:
        yield
    finally:
        _ROW_KERNELS.reset(token)
        with _LOCK:
            for module in used:
                entry = _USERS[module]
                entry[0] -= 1
                if not entry[0]:
                    del _USERS[module]
                    if vars(module).get("forward") is entry[1]:
                        del module.forward
