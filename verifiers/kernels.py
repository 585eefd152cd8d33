"""The matrix product of a few-token verify on a CPU, at the cost of a one-token step.

A verify feeds 2-8 tokens; `generate` feeds one. For a float32 `nn.Linear` on a CPU, PyTorch computes
x @ W.T (x: [rows, in]) through MKL, which for 2-8 rows takes about twice as long as for one: on the 2-core
machine this project is measured on, SmolLM2-135M's forward costs 69 ms for 1 token, 120 ms for 2 and 116 ms
for 4. The same product computed as (W @ x.T).T streams the weights once, as the one-row kernel does: 58 ms
for 2 tokens, 63 ms for 4, 85 ms for 8 (`python -m experiments.verify_costs` prints both curves). Speculation
lives on that difference, so `narrow_linears` routes the verifier's few-row products through it while a
verify runs.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

# Rows (tokens x batch rows) for which (W @ x.T).T beats x @ W.T on CPUs; past 8 the two cost about the same.
NARROW_ROWS = range(2, 9)


def narrow_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, with the weight as the left operand when x has NARROW_ROWS rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows not in NARROW_ROWS:
        return F.linear(x, module.weight, module.bias)
    out = torch.mm(module.weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if module.bias is not None:
        out += module.bias
    return out.view(*x.shape[:-1], out.shape[-1])


def cpu_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's plain float32 `nn.Linear`s on a CPU (subclasses, e.g. quantised ones, keep their own kernels)."""
    return [
        m
        for m in model.modules()
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
    ]


# module -> how many `narrow_linears` blocks (threads) use it now; the last one out restores `nn.Linear.forward`.
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


@contextlib.contextmanager
def narrow_linears(linears: list[nn.Linear]):
    """Within the block, `linears` compute through `narrow_linear`; afterwards they are as they were (the
    user's model is never left changed, and concurrent blocks on one model nest)."""
    with _LOCK:
        for module in linears:
            if not _USERS.get(module):
                module.forward = types.MethodType(narrow_linear, module)
            _USERS[module] = _USERS.get(module, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            for module in linears:
                _USERS[module] -= 1
                if not _USERS[module]:
                    del module.forward
