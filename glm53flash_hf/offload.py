"""Reading offloaded parameters outside their module's own forward (big-model loading).

``from_pretrained(device_map=..., offload_folder=..., max_memory=...)`` lets accelerate attach an
``AlignDevicesHook`` (``module._hf_hook``, ``accelerate/hooks.py``) to every module that holds parameters of an
offloaded block. The hook loads the module's parameters in ``pre_forward`` and puts meta placeholders back in
``post_forward``: the weights hold data only while the module's own ``forward`` runs. Code that reads a child's
parameter directly — the KDA layer binding ``conv1d.weight`` for its convolution, the fused KDA path binding the
gate and norm parameters, the indexer's cached step called as a method — goes through :func:`call_onloaded`.
"""

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
    """``fn()`` with the parameters of ``modules`` loaded, even when accelerate offloaded them.

    Each hooked module's ``_hf_hook.pre_forward`` runs before ``fn`` and its ``post_forward`` after (reverse order),
    as around the module's own forward. Tensors ``fn`` returns keep the loaded data (the hook swaps the module's
    parameters for new meta ones; it does not free the loaded tensors). Without hooks (no device map) this is
    ``fn()``. ``fn`` must not call a listed module: that module's hook would offload its weights on return.
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
