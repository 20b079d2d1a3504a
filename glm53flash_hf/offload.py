"""Reading parameters that accelerate offloads (``from_pretrained(device_map=..., offload_folder=...)``) outside
their module's own forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

__all__ = ["call_onloaded", "is_offload_hooked"]

T = TypeVar("T")


def is_offload_hooked(module: nn.Module | None) -> bool:
    """Whether accelerate attached a hook to ``module`` (its parameters may be meta outside its forward)."""
    return module is not None and getattr(module, "_hf_hook", None) is not None


def call_onloaded(modules: tuple[nn.Module | None, ...], fn: Callable[[], T]) -> T:
    """``fn()`` with the parameters of ``modules`` loaded by their accelerate hooks (``pre_forward`` before,
    ``post_forward`` after, reverse order); ``fn()`` without hooks. ``fn`` must not call a listed module.
    """
    hooked = [m for m in modules if is_offload_hooked(m)]
    if not hooked:
        return fn()
    for m in hooked:
        m._hf_hook.pre_forward(m)
    try:
        return fn()
    finally:
        for m in reversed(hooked):
            m._hf_hook.post_forward(m, None)
