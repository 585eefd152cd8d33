"""The matrix kernel each plain float32 CPU `nn.Linear` of the verifier runs, chosen per number of rows.

A forward of m fed tokens over b rows multiplies every weight by a [b * m, in] input. PyTorch computes that as
x @ W.T; computed as (W @ x.T).T ("weight-left") the same product streams the weights once, as the one-row
kernel does. Which is faster depends on the CPU and its BLAS: on one 2-core Xeon the weight-left form halves a
verify of 2-8 rows, on another it doubles it. So nothing here decides: `schedulers.cost_model` times a forward
of every width with each kernel on the user's machine, once, and caches the choice with the cost table; a
`Verifier` runs the row counts where weight-left was measured faster through it (`chosen_kernels`) and leaves
every other product to PyTorch. `force_kernel` pins one kernel for every row count (the cost probe measures each
candidate through it, and tests run the losslessness properties under each).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("torch", "weight-left")  # PyTorch's own x @ W.T, and (W @ x.T).T

# What the linear forwards installed by `chosen_kernels` compute in this thread; outside a block (another thread
# calling the same model, e.g. the user's own `model.generate`) they compute PyTorch's product.
_WEIGHT_LEFT_ROWS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "weight_left_rows", default=frozenset()
)
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("forced_kernel", default=None)


def weight_left_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` computed as (W @ x.T).T."""
    rows = _rows(x)
    out = torch.mm(module.weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if module.bias is not None:
        out += module.bias
    return out.view(*x.shape[:-1], out.shape[-1])


def _chosen_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    kernel = _FORCED.get()
    if kernel is None:
        kernel = "weight-left" if _rows(x) in _WEIGHT_LEFT_ROWS.get() else "torch"
    if kernel == "weight-left" and x.shape[-1]:
        return weight_left_linear(module, x)
    return F.linear(x, module.weight, module.bias)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def cpu_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's linears whose product a kernel choice can reproduce exactly: plain float32 `nn.Linear`s on a
    CPU. Subclasses (quantised or parametrised ones) and modules carrying their own `forward` (a wrapper put on
    the instance, as accelerate's offloading hooks do) keep what they compute. Forward hooks run either way."""
    return [
        m
        for m in model.modules()
        if type(m) is nn.Linear
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
def chosen_kernels(linears: list[nn.Linear], weight_left_rows: frozenset[int], rows: int | None = None):
    """Within the block, `linears` compute products of `weight_left_rows` rows as (W @ x.T).T (all of them under
    `force_kernel("weight-left")`) and the rest through PyTorch. Afterwards every module is as it was: a module that
    has gained its own `forward` meanwhile is left alone, and concurrent blocks on one model nest.

    `rows`: the row count of the block's dense products, when the caller knows it (a forward of every fed position).
    Where PyTorch's kernel serves it, nothing is installed: installing and removing a forward on each of a model's
    hundreds of linears costs milliseconds, a few percent of a CPU step."""
    forced = _FORCED.get()
    if forced == "torch" or (
        forced is None and (not weight_left_rows or rows is not None and rows not in weight_left_rows)
    ):
        yield  # nothing to change: PyTorch's own forward
        return
    token = _WEIGHT_LEFT_ROWS.set(weight_left_rows)
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
        _WEIGHT_LEFT_ROWS.reset(token)
        with _LOCK:
            for module in used:
                entry = _USERS[module]
                entry[0] -= 1
                if not entry[0]:
                    del _USERS[module]
                    if vars(module).get("forward") is entry[1]:
                        del module.forward
