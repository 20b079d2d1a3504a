"""fla-core as this package calls it: the only module that imports ``fla``.

:mod:`.kda_fused` runs fla-core's KDA kernels inside its own custom ops, so it calls the functions behind fla's
autograd Functions, which are not in fla's public API (no package ``__all__`` lists them). Every such name is
imported here and nowhere else:

* ``fla.modules.norm.l2norm``: ``l2norm_fwd``, ``l2norm_bwd``;
* ``fla.ops.common.gate``: ``fused_beta_sigmoid_fwd``, ``fused_beta_sigmoid_bwd``;
* ``fla.ops.utils.index.prepare_chunk_indices``;
* ``fla.ops.kda.chunk_fwd.chunk_kda_fwd``, ``fla.ops.kda.chunk_bwd.chunk_kda_bwd``;
* ``fla.modules.causal_conv1d.ops``: ``causal_conv1d_fwd``, ``causal_conv1d_bwd``;
* ``fla.modules.norm.fused_norm_gate``: ``layer_norm_gated_fwd``, ``layer_norm_gated_bwd``;
* ``fla.ops.cp.context._check_cp_device`` (behind :func:`cp_device_error`).

and the public entry points the package uses: ``fla.ops.kda.fused_recurrent_kda``, ``fla.ops.kda.chunk_kda`` and
``fla.ops.cp.build_cp_context``.

Versions: checked against fla-core :data:`FLA_CHECKED`; the package requires ``fla-core`` :data:`FLA_REQUIREMENT`
(``setup.cfg``'s ``gpu`` and ``test`` extras state the same range). The signatures of these functions change between
fla releases, so every call goes through :func:`call_checked`: all arguments by keyword, each checked against the
installed function's signature, so a renamed or dropped parameter raises ``TypeError`` instead of being swallowed by
a ``**kwargs``.

fla is imported lazily, inside ``try`` blocks (transformers' remote-code ``check_imports`` skips those), only when a
kernel runs or a probe asks: importing this module never imports fla.
"""

from __future__ import annotations

import functools
import inspect
import re
from types import SimpleNamespace

import torch

__all__ = [
    "FLA_REQUIREMENT",
    "FLA_CHECKED",
    "KWARGS_READ",
    "load",
    "import_error",
    "load_cp",
    "cp_device_error",
    "accepted_keywords",
    "call_checked",
]

FLA_REQUIREMENT = ">=0.6,<0.7"  # the fla-core range of setup.cfg's extras
FLA_CHECKED = ("0.6.0",)  # the fla-core releases the kernels' tests ran against

# fla function name -> keywords it reads from its **kwargs, accepted only where the installed source reads them.
KWARGS_READ: dict[str, tuple[str, ...]] = {"chunk_kda": ("A_log", "dt_bias", "chunk_size")}

_ACCEPTED: dict = {}  # function object -> frozenset of accepted keywords
_INSTALL = f"pip install 'fla-core{FLA_REQUIREMENT}'"


@functools.lru_cache(maxsize=1)
def load() -> SimpleNamespace:
    """Import fla-core's functions once.

    Returns:
        A namespace with ``version`` (fla's ``__version__``) and the functions listed in the module docstring under
        their fla names (``l2norm_fwd``, ..., ``layer_norm_gated_bwd``, ``fused_recurrent_kda``).

    Raises:
        ImportError: fla cannot be imported (the message names the cause and the required range).
    """
    try:
        import fla
        from fla.modules.causal_conv1d.ops import causal_conv1d_bwd, causal_conv1d_fwd
        from fla.modules.norm.fused_norm_gate import layer_norm_gated_bwd, layer_norm_gated_fwd
        from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
        from fla.ops.common.gate import fused_beta_sigmoid_bwd, fused_beta_sigmoid_fwd
        from fla.ops.kda import fused_recurrent_kda
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd
        from fla.ops.utils.index import prepare_chunk_indices
    except Exception as exc:  # ImportError, or a triton/driver error raised while fla initialises
        raise ImportError(f"fla-core cannot be imported ({type(exc).__name__}: {exc}); {_INSTALL}") from exc
    return SimpleNamespace(
        version=getattr(fla, "__version__", "unknown"),
        l2norm_fwd=l2norm_fwd,
        l2norm_bwd=l2norm_bwd,
        fused_beta_sigmoid_fwd=fused_beta_sigmoid_fwd,
        fused_beta_sigmoid_bwd=fused_beta_sigmoid_bwd,
        prepare_chunk_indices=prepare_chunk_indices,
        chunk_kda_fwd=chunk_kda_fwd,
        chunk_kda_bwd=chunk_kda_bwd,
        causal_conv1d_fwd=causal_conv1d_fwd,
        causal_conv1d_bwd=causal_conv1d_bwd,
        layer_norm_gated_fwd=layer_norm_gated_fwd,
        layer_norm_gated_bwd=layer_norm_gated_bwd,
        fused_recurrent_kda=fused_recurrent_kda,
    )


@functools.lru_cache(maxsize=1)
def import_error() -> str | None:
    """Why :func:`load` fails (its ``ImportError`` message), or ``None`` when fla imports. Cached."""
    try:
        load()
    except ImportError as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=1)
def load_cp() -> SimpleNamespace:
    """Import fla-core's context-parallel KDA once.

    Returns:
        A namespace with ``chunk_kda`` (the entry point that takes ``cp_context``), ``build_cp_context`` and
        ``context`` (the module ``fla.ops.cp.context``).

    Raises:
        ImportError: the CP modules cannot be imported (naming the cause).
    """
    try:
        from fla.ops.cp import build_cp_context
        from fla.ops.cp import context as cp_context_module
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # ImportError, or a triton/driver error raised while fla initialises
        raise ImportError(
            f"fla-core's context-parallel KDA cannot be imported ({type(exc).__name__}: {exc}); {_INSTALL}"
        ) from exc
    return SimpleNamespace(chunk_kda=chunk_kda, build_cp_context=build_cp_context, context=cp_context_module)


def cp_device_error(device: torch.device) -> str | None:
    """Why fla's context-parallel kernels refuse ``device`` (fla's own device check, looked up at each call:
    NVIDIA compute capability >= 8.0, or Ascend), or ``None`` when they accept it.

    Raises:
        ImportError: as :func:`load_cp`.
    """
    try:
        load_cp().context._check_cp_device(torch.device(device))
    except RuntimeError as exc:
        return str(exc)
    return None


def accepted_keywords(fn, name: str, kwargs_names: tuple[str, ...] = ()) -> frozenset:
    """The keywords a call of ``fn`` may pass without being silently ignored.

    Args:
        fn: the installed function (decorators are unwrapped through ``__wrapped__``).
        name: its name, for messages.
        kwargs_names: names the function is documented to read from its ``**kwargs``.

    Returns:
        The named parameters of ``fn`` (positional-or-keyword and keyword-only), plus each of ``kwargs_names`` that
        the function's source reads from its ``**kwargs`` (``kwargs.get("x")``, ``kwargs.pop("x", ...)``,
        ``kwargs["x"]``). A function without ``**kwargs``, or whose source cannot be read, gets no extras.

    Raises:
        TypeError: ``fn`` has no inspectable signature (naming ``name``).
    """
    base = inspect.unwrap(fn)
    try:
        params = inspect.signature(base).parameters.values()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot read the signature of fla's {name} ({exc}); refusing to call it unchecked") from exc
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = [p.name for p in params if p.kind is p.VAR_KEYWORD]
    extra = set()
    if var_kw and kwargs_names:
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            source = ""
        kw = re.escape(var_kw[0])
        for n in kwargs_names:
            q = re.escape(n)
            if re.search(rf"\b{kw}\s*(?:\.\s*(?:get|pop)\s*\(\s*|\[\s*)['\"]{q}['\"]", source):
                extra.add(n)
    return frozenset(named | extra)


def call_checked(fn, name: str, **kwargs):
    """Call the fla function ``fn`` with keyword arguments only, after checking that it accepts every one.

    The accepted set (:func:`accepted_keywords` with ``KWARGS_READ[name]``) is computed once per function object.

    Args:
        fn: the fla function.
        name: its fla name (``"chunk_kda_fwd"``, ...), used for :data:`KWARGS_READ` and messages.
        kwargs: the arguments.

    Returns:
        Whatever ``fn`` returns.

    Raises:
        TypeError: a keyword is not accepted (naming the function and the argument(s)): fla would ignore it silently.
    """
    accepted = _ACCEPTED.get(fn)
    if accepted is None:
        accepted = _ACCEPTED[fn] = accepted_keywords(fn, name, KWARGS_READ.get(name, ()))
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise TypeError(
            f"fla's {name} does not accept the argument(s) {unknown} (not a named parameter, and not read from its "
            f"**kwargs); calling it would silently ignore them. The installed fla-core is not a version this "
            f"package was checked against ({', '.join(FLA_CHECKED)}); use kernels={{'kda': 'torch'}} or {_INSTALL}"
        )
    return fn(**kwargs)
