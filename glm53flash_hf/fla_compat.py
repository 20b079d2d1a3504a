"""fla-core as this package calls it: the only module that imports ``fla``.

:mod:`.kda_fused` runs fla-core's KDA kernels inside its own custom ops, so it needs the bodies of fla's autograd
Functions (``ChunkKDAFunction``, ``CausalConv1dFunction``, ``LayerNormGatedFunction``: :func:`chunk_forward`,
:func:`chunk_backward`, :func:`conv_forward`, :func:`conv_backward`, :func:`norm_forward`, :func:`norm_backward`,
plus :func:`chunk_indices_of` and :func:`recurrent_step`), which call functions that are not in fla's public API (no
package ``__all__`` lists them). Those bodies and every such name are here and nowhere else:

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
    "chunk_indices_of",
    "chunk_forward",
    "chunk_backward",
    "conv_forward",
    "conv_backward",
    "norm_forward",
    "norm_backward",
    "recurrent_step",
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


# ================================================================================== the bodies of fla's Functions
# fla-core's ChunkKDAFunction, CausalConv1dFunction and LayerNormGatedFunction, forward and backward: the fla calls
# of each, with the arguments those Functions pass, so that results equal fla's entry points bit for bit. What the
# forward of a Function saves for its backward is returned to the caller (the custom ops of .kda_fused keep it).
def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def chunk_indices_of(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fla's chunk indices ``[NT, 2]`` (long) of the documents ``cu_seqlens`` (long, with its host copy)."""
    return call_checked(load().prepare_chunk_indices, "prepare_chunk_indices", cu_seqlens=cu_seqlens,
                        chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


def chunk_forward(q, k, v, g, beta, *, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                  scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                  safe_gate, lower_bound, chunk_size):
    """The forward of fla's ``ChunkKDAFunction`` on contiguous inputs (the arguments of ``chunk_kda``).

    Returns:
        ``(o, final_state or None, q, q_rstd, k, k_rstd, beta_act, g_cumsum or None, Aqk, Akk)``: ``q``/``k``
        l2-normalised with their reciprocal norms when ``use_qk_l2norm_in_kernel`` (else the inputs and ``None``),
        ``beta_act`` the sigmoid of ``beta`` when ``use_beta_sigmoid_in_kernel`` (else ``beta``).
    """
    fla = load()
    q_rstd = k_rstd = None
    if use_qk_l2norm_in_kernel:
        q, q_rstd = call_checked(fla.l2norm_fwd, "l2norm_fwd", x=q)
        k, k_rstd = call_checked(fla.l2norm_fwd, "l2norm_fwd", x=k)
    beta_act = beta
    if use_beta_sigmoid_in_kernel:
        beta_act = call_checked(fla.fused_beta_sigmoid_fwd, "fused_beta_sigmoid_fwd", x=beta, scale=1.0)
    o, final, g_cumsum, Aqk, Akk = call_checked(
        fla.chunk_kda_fwd,
        "chunk_kda_fwd",
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta_act,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        state_v_first=False,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
        chunk_size=chunk_size,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        disable_recompute=False,
        return_intermediate_states=False,
        cp_context=None,
        use_graph=False,
        chunk_offsets=None,
    )[:5]
    return o, final, q, q_rstd, k, k_rstd, beta_act, g_cumsum, Aqk, Akk


def chunk_backward(do, dht, q, k, v, beta, beta_act, g, g_cumsum, A_log, dt_bias, initial_state, Aqk, Akk,
                   cu_seqlens, chunk_indices, *, q_normed, q_rstd, k_normed, k_rstd, scale, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, safe_gate, lower_bound, chunk_size):
    """The backward of fla's ``ChunkKDAFunction``: ``q``/``k`` as the kernel read them (normalised when
    ``use_qk_l2norm_in_kernel``), the rest as :func:`chunk_forward` took and returned them.

    Returns:
        ``(dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias)`` (fla's; ``None`` where fla has none).
    """
    fla = load()
    dq, dk, dv, db, dg, dh0, dA, dbias = call_checked(
        fla.chunk_kda_bwd,
        "chunk_kda_bwd",
        q=q,
        k=k,
        v=v.contiguous(),
        beta=beta_act if use_beta_sigmoid_in_kernel else beta.contiguous(),
        Aqk=Aqk,
        Akk=Akk,
        scale=scale,
        initial_state=initial_state,
        do=do.contiguous(),
        dht=_contiguous(dht),
        g=None if use_gate_in_kernel else g_cumsum,
        g_org=g if use_gate_in_kernel else None,
        state_v_first=False,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.long),
        chunk_indices=chunk_indices if cu_seqlens is not None else None,
        chunk_size=chunk_size,
        safe_gate=safe_gate,
        lower_bound=lower_bound,
        use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        disable_recompute=False,
        cp_context=None,
        use_graph=False,
        chunk_offsets=None,
    )
    if use_qk_l2norm_in_kernel:
        dq = call_checked(fla.l2norm_bwd, "l2norm_bwd", y=q_normed, rstd=q_rstd, dy=dq)
        dk = call_checked(fla.l2norm_bwd, "l2norm_bwd", y=k_normed, rstd=k_rstd, dy=dk)
    if use_beta_sigmoid_in_kernel:
        db = call_checked(fla.fused_beta_sigmoid_bwd, "fused_beta_sigmoid_bwd", x=beta.contiguous(), dy=db,
                          scale=1.0)
    return dq, dk, dv, db, dg, dh0, dA, dbias


def conv_forward(x, weight, *, initial_state, output_final_state, activation, cu_seqlens, cu_seqlens_cpu,
                 chunk_indices, chunk_size):
    """The forward of fla's ``CausalConv1dFunction`` without bias or residual: ``(y, final_state or None)``."""
    return call_checked(
        load().causal_conv1d_fwd,
        "causal_conv1d_fwd",
        x=x,
        weight=weight,
        bias=None,
        residual=None,
        initial_state=initial_state,
        output_final_state=output_final_state,
        activation=activation,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
        chunk_size=chunk_size,
    )


def conv_backward(x, dy, dht, weight, *, initial_state, activation, cu_seqlens, chunk_indices, chunk_size):
    """The backward of fla's ``CausalConv1dFunction`` without bias or residual: ``(dx, dweight, dh0 or None)``."""
    dx, dw, _, _, dh0 = call_checked(
        load().causal_conv1d_bwd,
        "causal_conv1d_bwd",
        x=x,
        dy=dy,
        dht=_contiguous(dht),
        weight=weight.contiguous(),
        bias=None,
        residual=None,
        initial_state=_contiguous(initial_state),
        activation=activation,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.long),
        chunk_indices=chunk_indices if cu_seqlens is not None else None,
        chunk_size=chunk_size,
    )
    return dx, dw, dh0


def norm_forward(x, g, weight, eps):
    """The forward of fla's ``LayerNormGatedFunction`` as RMSNorm with a sigmoid gate, no bias or residual, on rows
    ``[N, D]``: ``(y, rstd)``."""
    y, _, rstd, _ = call_checked(
        load().layer_norm_gated_fwd,
        "layer_norm_gated_fwd",
        x=x,
        g=g,
        weight=weight,
        bias=None,
        activation="sigmoid",
        eps=eps,
        residual=None,
        residual_dtype=None,
        is_rms_norm=True,
    )
    return y, rstd


def norm_backward(dy, x, g, weight, rstd, eps, x_dtype):
    """The backward of :func:`norm_forward`: ``(dx, dg, dweight)``."""
    dx, dg, dw, _, _ = call_checked(
        load().layer_norm_gated_bwd,
        "layer_norm_gated_bwd",
        dy=dy,
        x=x,
        g=g,
        weight=weight,
        bias=None,
        activation="sigmoid",
        eps=eps,
        mean=None,
        rstd=rstd,
        dresidual=None,
        has_residual=False,
        is_rms_norm=True,
        x_dtype=x_dtype,
    )
    return dx, dg, dw


def recurrent_step(q, k, v, g, beta, A_log, dt_bias, *, initial_state, scale, lower_bound):
    """fla's ``fused_recurrent_kda`` with the gate, the beta sigmoid and the q/k l2-norm in the kernel, K-first state:
    ``(o, final_state)``."""
    return tuple(call_checked(
        load().fused_recurrent_kda,
        "fused_recurrent_kda",
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log,
        dt_bias=dt_bias,
        scale=scale,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        lower_bound=lower_bound,
        state_v_first=False,
    ))
