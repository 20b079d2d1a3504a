"""fla-core as this package calls it: the only module that imports ``fla``.

:func:`load` and :func:`load_cp` import fla at their first call (inside ``try`` blocks), never on import (probes
:func:`import_error`, :func:`cp_device_error`); :func:`checked` makes every fla call by keyword, each keyword checked;
:func:`chunk_forward` ... :func:`recurrent_step` are the bodies of :mod:`.kda_fused`'s custom ops;
:func:`prune_by_shared_memory` keeps fla's autotuners to the configurations whose compiled kernel fits the device's
shared memory per block.

fla names used that are not in fla's public API (no fla package ``__all__`` lists them), here and nowhere else: the
imports of :func:`load` other than ``fused_recurrent_kda``, and ``fla.ops.cp.context._check_cp_device`` (behind
:func:`cp_device_error`). Public entry points used: ``fla.ops.kda.fused_recurrent_kda``, ``fla.ops.kda.chunk_kda``,
``fla.ops.cp.build_cp_context``.

Versions: checked against fla-core :data:`FLA_CHECKED`; requires ``fla-core`` :data:`FLA_REQUIREMENT` (the range of
``setup.cfg``'s ``gpu`` and ``test`` extras). Source: fla-core (github.com/fla-org/flash-linear-attention),
``fla/ops/kda/chunk.py``, ``fla/modules/causal_conv1d/ops.py``, ``fla/modules/norm/fused_norm_gate.py``; reasons:
``docs/design.md``, section "KDA".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import sys
from types import SimpleNamespace

import torch
from torch import Tensor

from .kda_ops import check_conv_inputs, check_cu_seqlens, check_state

__all__ = ["FLA_REQUIREMENT", "FLA_CHECKED", "KWARGS_READ", "load", "import_error", "load_cp", "cp_device_error",
           "accepted_keywords", "checked", "fla_autotuners", "prune_by_shared_memory", "install_shared_memory_prune",
           "shared_memory_need", "chunk_forward", "chunk_backward", "chunk_context_parallel", "conv_forward",
           "conv_backward", "norm_forward", "norm_backward", "recurrent_step"]

FLA_REQUIREMENT = ">=0.6,<0.7"  # the fla-core range of setup.cfg's extras
FLA_CHECKED = ("0.6.0",)  # the fla-core releases the kernels' tests ran against

# fla function name -> keywords it reads from its **kwargs, accepted only where the installed source reads them.
KWARGS_READ: dict[str, tuple[str, ...]] = {"chunk_kda": ("A_log", "dt_bias", "chunk_size")}

_ACCEPTED: dict = {}  # function object -> frozenset of accepted keywords
_INSTALL = f"pip install 'fla-core{FLA_REQUIREMENT}'"


@functools.lru_cache(maxsize=1)
def load() -> SimpleNamespace:
    """Import fla-core's functions once: a namespace with ``version`` (fla's ``__version__``) and the functions it
    imports, under their fla names.

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
    _PRUNE["pending"] = True
    return SimpleNamespace(
        version=getattr(fla, "__version__", "unknown"), l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd,
        fused_beta_sigmoid_fwd=fused_beta_sigmoid_fwd, fused_beta_sigmoid_bwd=fused_beta_sigmoid_bwd,
        prepare_chunk_indices=prepare_chunk_indices, chunk_kda_fwd=chunk_kda_fwd, chunk_kda_bwd=chunk_kda_bwd,
        causal_conv1d_fwd=causal_conv1d_fwd, causal_conv1d_bwd=causal_conv1d_bwd,
        layer_norm_gated_fwd=layer_norm_gated_fwd, layer_norm_gated_bwd=layer_norm_gated_bwd,
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
    """Import fla-core's context-parallel KDA once: a namespace with ``chunk_kda`` (the entry point that takes
    ``cp_context``), ``build_cp_context`` and ``context`` (the module ``fla.ops.cp.context``).

    Raises:
        ImportError: the CP modules cannot be imported (naming the cause).
    """
    try:
        from fla.ops.cp import build_cp_context
        from fla.ops.cp import context as cp_context_module
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # ImportError, or a triton/driver error raised while fla initialises
        raise ImportError(f"fla-core's context-parallel KDA cannot be imported ({type(exc).__name__}: {exc}); "
                          f"{_INSTALL}") from exc
    _PRUNE["pending"] = True
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
    """The keywords a call of ``fn`` (unwrapped through ``__wrapped__``) may pass without being silently ignored: its
    named parameters, plus each of ``kwargs_names`` that its source reads from its ``**kwargs``
    (``kwargs.get("x")``, ``kwargs.pop("x", ...)``, ``kwargs["x"]``).

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
        extra = {n for n in kwargs_names
                 if re.search(rf"\b{kw}\s*(?:\.\s*(?:get|pop)\s*\(\s*|\[\s*)['\"]{re.escape(n)}['\"]", source)}
    return frozenset(named | extra)


def checked(namespace, name: str, **kwargs) -> functools.partial:
    """The fla function ``namespace.<name>`` bound to ``kwargs`` (keywords only), to be called: ``checked(...)()``.

    Every keyword is checked against the function (:func:`accepted_keywords` with ``KWARGS_READ[name]``, computed once
    per function object). The first binding with a CUDA tensor after :func:`load` / :func:`load_cp` imported fla runs
    :func:`install_shared_memory_prune`.

    Raises:
        TypeError: a keyword is not accepted (naming the function and the argument(s)).
    """
    fn = getattr(namespace, name)
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
    if _PRUNE["pending"] and any(isinstance(v, Tensor) and v.device.type == "cuda" for v in kwargs.values()):
        install_shared_memory_prune()
    return functools.partial(fn, **kwargs)


_PRUNE = {"pending": False}  # True after load()/load_cp() imported fla modules not yet walked
_PRUNED_MARK = "_glm53flash_shared_memory_prune"  # attribute set on an autotuner once its prune is chained
_LOG = logging.getLogger(__name__)


def fla_autotuners() -> list:
    """Every Triton ``Autotuner`` reachable from a module-level name of the ``fla.*`` modules imported so far (through
    ``Heuristics`` wrappers), each once, in import order; empty when triton or fla is not imported. Imports nothing."""
    if "triton.runtime.autotuner" not in sys.modules:
        return []
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction, KernelInterface

    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(module).values()):
            while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
                if isinstance(obj, Autotuner) and id(obj) not in seen:
                    seen.add(id(obj))
                    found.append(obj)
                obj = getattr(obj, "fn", None)
    return found


def shared_memory_need(tuner, config, nargs: dict, kwargs: dict) -> int | None:
    """Bytes of shared memory per block that ``tuner``'s kernel compiled with ``config`` needs on the current device
    (the compiled kernel's ``metadata.shared``), or ``None`` when it does not compile or has no such metadata.

    The kernel is compiled for the active driver's target, not loaded or launched (``JITFunction.run(..., warmup=True)``
    with the launch's arguments ``nargs`` by parameter name and ``kwargs`` as ``early_config_prune`` receives them).
    """
    call = {**nargs, **kwargs, **config.all_kwargs(), "warmup": True}
    call.setdefault("grid", (1,))
    try:
        kernel = tuner.fn.run(**call)
    except Exception as exc:  # a configuration that does not compile is the autotuner's to report or skip
        _LOG.debug("%s %s does not compile (%s: %s)", _kernel_name(tuner), config, type(exc).__name__, exc)
        return None
    shared = getattr(getattr(kernel, "metadata", None), "shared", None)
    return None if shared is None else int(shared)


def _kernel_name(tuner) -> str:
    return getattr(getattr(tuner, "base_fn", None), "__name__", type(tuner).__name__)


def _max_shared_memory() -> int:
    from triton.runtime import driver

    active = driver.active
    return int(active.utils.get_device_properties(active.get_current_device())["max_shared_mem"])


def prune_by_shared_memory(tuner, on_drop=None) -> bool:
    """Chain onto ``tuner``'s ``early_config_prune`` (after its own, if any) a prune that drops the configurations
    whose compiled kernel (:func:`shared_memory_need`) needs more shared memory per block than the current device's
    ``max_shared_mem``; configurations of unknown need are kept, and if none fits the list is returned unchanged.
    ``on_drop(tuner, config, need, limit)`` is called for each dropped one. Returns ``False`` when ``tuner`` already
    had the prune (idempotent), else ``True``.

    Raises:
        TypeError: ``tuner`` is not a triton ``Autotuner``.
    """
    from triton.runtime.autotuner import Autotuner

    if not isinstance(tuner, Autotuner):
        raise TypeError(f"prune_by_shared_memory: tuner must be a triton Autotuner, got {type(tuner).__name__}")
    if getattr(tuner, _PRUNED_MARK, False):
        return False
    previous = tuner.early_config_prune

    def early_config_prune(configs, nargs, **kwargs):
        if previous is not None:
            configs = previous(configs, nargs, **kwargs)
        limit = _max_shared_memory()
        needs = [shared_memory_need(tuner, config, nargs, kwargs) for config in configs]
        kept = [c for c, need in zip(configs, needs) if need is None or need <= limit]
        dropped = [(c, need) for c, need in zip(configs, needs) if need is not None and need > limit]
        if not kept:
            return configs
        for config, need in dropped:
            _LOG.debug("%s: dropped %s (shared %d B > %d B)", _kernel_name(tuner), config, need, limit)
            if on_drop is not None:
                on_drop(tuner, config, need, limit)
        return kept

    tuner.early_config_prune = early_config_prune
    setattr(tuner, _PRUNED_MARK, True)
    return True


def install_shared_memory_prune() -> int:
    """:func:`prune_by_shared_memory` on every autotuner of :func:`fla_autotuners`; returns how many got it now.
    Run by :func:`checked` at the first fla call with a CUDA tensor after fla was imported; idempotent."""
    _PRUNE["pending"] = False
    return sum(prune_by_shared_memory(tuner) for tuner in fla_autotuners())


# The forward and backward of fla-core's ChunkKDAFunction, CausalConv1dFunction and LayerNormGatedFunction (the fla
# calls of each, with the arguments those Functions pass), as the bodies of kda_fused's custom ops: tensors in, a
# tensor or a tuple of new tensors out, an empty tensor for an output that does not exist. The checks that read
# cu_seqlens run here (a traced graph cannot read data); the others ran in kda_fused's public functions. Each body
# also raises ImportError and TypeError as load() / load_cp() and checked() do.
_CONV_CHUNK = 64  # fla's CausalConv1dFunction default chunk size
_NORM = dict(bias=None, activation="sigmoid", is_rms_norm=True)  # fla's gated norm as RMSNorm * sigmoid(gate)


def _device(t: Tensor):
    """The CUDA device context of ``t`` (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


def _chunk_indices(fla, cu_seqlens: Tensor, cu_host: list[int], chunk_size: int):
    """``(cu_seqlens long, its host copy, fla's chunk indices [NT, 2] long: document, chunk within it)``."""
    cu = cu_seqlens.to(torch.long)
    cu_cpu = torch.tensor(cu_host, dtype=torch.long)
    return cu, cu_cpu, checked(fla, "prepare_chunk_indices", cu_seqlens=cu, chunk_size=chunk_size,
                               cu_seqlens_cpu=cu_cpu)()


def chunk_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                  dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None, scale: float,
                  output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                  use_beta_sigmoid_in_kernel: bool, safe_gate: bool, lower_bound: float | None,
                  chunk_size: int) -> tuple[(Tensor,) * 11]:
    """The forward of fla's ``ChunkKDAFunction``, arguments as fla's ``chunk_kda`` (``initial_state`` fp32).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state fp32 [N, H, K, V])`` and the backward's residuals ``q``, ``q_rstd``,
        ``k``, ``k_rstd`` (l2-normalised, reciprocal norms), ``beta_act`` (sigmoid), ``g_cumsum``, ``Aqk``, ``Akk``,
        ``chunk_indices [NT, 2]`` long; empty where absent (``chunk_indices`` ``[0, 2]`` without ``cu_seqlens``).

    Raises:
        ValueError: bad ``cu_seqlens``, or an ``initial_state`` that does not match them.
    """
    B, T, H, K = q.shape
    cu = cu_cpu = indices = None
    if cu_seqlens is not None:
        cu_host = check_cu_seqlens(cu_seqlens, T, B, "q.shape[0]")
        check_state(initial_state, len(cu_host) - 1, H, K, v.shape[-1])
    fla = load()
    with _device(q):
        q, k, v, g, beta, A_log, dt_bias, initial_state = map(
            _contiguous, (q, k, v, g, beta, A_log, dt_bias, initial_state))
        if cu_seqlens is not None:
            cu, cu_cpu, indices = _chunk_indices(fla, cu_seqlens, cu_host, chunk_size)
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = checked(fla, "l2norm_fwd", x=q)()
            k, k_rstd = checked(fla, "l2norm_fwd", x=k)()
        beta_act = beta
        if use_beta_sigmoid_in_kernel:
            beta_act = checked(fla, "fused_beta_sigmoid_fwd", x=beta, scale=1.0)()
        o, final, g_cumsum, Aqk, Akk = checked(
            fla, "chunk_kda_fwd", q=q, k=k, v=v, g=g, beta=beta_act, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, state_v_first=False, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
            chunk_indices=indices, chunk_size=chunk_size, safe_gate=safe_gate, lower_bound=lower_bound,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, disable_recompute=False,
            return_intermediate_states=False, cp_context=None, use_graph=False, chunk_offsets=None)()[:5]
    l2 = use_qk_l2norm_in_kernel
    residuals = (q, q_rstd, k, k_rstd) if l2 else (None,) * 4
    residuals += (beta_act if use_beta_sigmoid_in_kernel else None, g_cumsum)
    return (o.type_as(q), _or_empty(final, q), *(_or_empty(t, q) for t in residuals), Aqk, Akk,
            indices if indices is not None else q.new_empty((0, 2), dtype=torch.long))


def chunk_backward(do: Tensor, dht: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                   A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
                   cu_seqlens: Tensor | None, q_normed: Tensor, q_rstd: Tensor, k_normed: Tensor, k_rstd: Tensor,
                   beta_act: Tensor, g_cumsum: Tensor, Aqk: Tensor, Akk: Tensor, chunk_indices: Tensor, scale: float,
                   use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                   safe_gate: bool, lower_bound: float | None, chunk_size: int) -> tuple[(Tensor,) * 8]:
    """The backward of fla's ``ChunkKDAFunction``: ``do`` ``[B, T, H, V]``, ``dht`` fp32 ``[N, H, K, V]`` or ``None``,
    the forward's inputs and :func:`chunk_forward`'s residuals. Returns ``(dq, dk, dv, dg, dbeta, dA_log, ddt_bias,
    dh0)``, each shaped and typed as its input (empty where the input is ``None``).
    """
    fla = load()
    l2, sig = use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel
    with _device(q):
        g_in, A_log, dt_bias, initial_state = map(_contiguous, (g, A_log, dt_bias, initial_state))
        dq, dk, dv, db, dg, dh0, dA, dbias = checked(
            fla, "chunk_kda_bwd", q=q_normed if l2 else q.contiguous(), k=k_normed if l2 else k.contiguous(),
            v=v.contiguous(), beta=beta_act if sig else beta.contiguous(), Aqk=Aqk, Akk=Akk, scale=scale,
            initial_state=initial_state, do=do.contiguous(), dht=_contiguous(dht),
            g=None if use_gate_in_kernel else g_cumsum, g_org=g_in if use_gate_in_kernel else None,
            state_v_first=False, cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.long),
            chunk_indices=chunk_indices if cu_seqlens is not None else None, chunk_size=chunk_size,
            safe_gate=safe_gate, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
            dt_bias=dt_bias, disable_recompute=False, cp_context=None, use_graph=False, chunk_offsets=None)()
        if l2:
            dq = checked(fla, "l2norm_bwd", y=q_normed, rstd=q_rstd, dy=dq)()
            dk = checked(fla, "l2norm_bwd", y=k_normed, rstd=k_rstd, dy=dk)()
        if sig:
            db = checked(fla, "fused_beta_sigmoid_bwd", x=beta.contiguous(), dy=db, scale=1.0)()
    return (dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), _or_empty(dA, q), _or_empty(dbias, q),
            _or_empty(dh0, q))


def chunk_context_parallel(cp_context, **kwargs) -> Tensor:
    """fla's public ``chunk_kda`` with ``cp_context`` (keyword arguments as fla's, on ``q``'s device); returns ``o``."""
    with _device(kwargs["q"]):
        return checked(load_cp(), "chunk_kda", cp_context=cp_context, **kwargs)()[0]


def conv_forward(x: Tensor, weight: Tensor, initial_state: Tensor | None, cu_seqlens: Tensor | None,
                 activation: str | None, output_final_state: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The forward of fla's ``CausalConv1dFunction`` without bias or residual: ``x`` ``[B, T, D]``, ``weight``
    ``[D, W]``, ``initial_state`` ``[N, D, W]`` or ``None``, ``activation`` ``"silu"`` or ``None``. Returns
    ``(y [B, T, D] in x's dtype, final_state [N, D, W] or empty, chunk_indices [NT, 2] long or [0, 2])``.

    Raises:
        ValueError: bad ``cu_seqlens``, or an ``initial_state`` that does not match them.
    """
    cu = cu_cpu = indices = None
    if cu_seqlens is not None:
        cu_host = check_conv_inputs(x, weight, activation, initial_state, cu_seqlens)
    fla = load()
    with _device(x):
        if cu_seqlens is not None:
            cu, cu_cpu, indices = _chunk_indices(fla, cu_seqlens, cu_host, _CONV_CHUNK)
        y, final = checked(
            fla, "causal_conv1d_fwd", x=x, weight=weight.contiguous(), bias=None, residual=None,
            initial_state=_contiguous(initial_state), output_final_state=output_final_state, activation=activation,
            cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=indices, chunk_size=_CONV_CHUNK)()
    return y, _or_empty(final, x), indices if indices is not None else x.new_empty((0, 2), dtype=torch.long)


def conv_backward(dy: Tensor, dht: Tensor | None, x: Tensor, weight: Tensor, initial_state: Tensor | None,
                  cu_seqlens: Tensor | None, chunk_indices: Tensor, activation: str | None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`conv_forward` (``dy`` as ``x``, ``dht`` as the final state or ``None``). Returns
    ``(dx, dweight, dh0 or empty)``.
    """
    with _device(x):
        dx, dw, _, _, dh0 = checked(
            load(), "causal_conv1d_bwd", x=x, dy=dy, dht=_contiguous(dht), weight=weight.contiguous(), bias=None,
            residual=None, initial_state=_contiguous(initial_state), activation=activation,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.long),
            chunk_indices=chunk_indices if cu_seqlens is not None else None, chunk_size=_CONV_CHUNK)()
    return dx, dw, _or_empty(dh0, x)


def norm_forward(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The forward of fla's ``LayerNormGatedFunction`` as RMSNorm with a sigmoid gate, no bias or residual: ``x``,
    ``gate`` ``[..., D]``, ``weight`` ``[D]``. Returns ``(y in x's shape and dtype, rstd fp32 [x.numel() // D])``.
    """
    dim = x.shape[-1]
    with _device(x):
        y, _, rstd, _ = checked(
            load(), "layer_norm_gated_fwd", x=x.contiguous().reshape(-1, dim), g=gate.contiguous().reshape(-1, dim),
            weight=weight.contiguous(), eps=eps, residual=None, residual_dtype=None, **_NORM)()
    return y.reshape(x.shape), rstd


def norm_backward(dy: Tensor, x: Tensor, gate: Tensor, weight: Tensor, rstd: Tensor, eps: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`norm_forward` (``dy`` as ``x``). Returns ``(dx, dgate, dweight)``."""
    dim = x.shape[-1]
    with _device(x):
        dx, dg, dw, _, _ = checked(
            load(), "layer_norm_gated_bwd", dy=dy.contiguous().reshape(-1, dim), x=x.contiguous().reshape(-1, dim),
            g=gate.contiguous().reshape(-1, dim), weight=weight.contiguous(), eps=eps, mean=None, rstd=rstd,
            dresidual=None, has_residual=False, x_dtype=x.dtype, **_NORM)()
    return dx.reshape(x.shape), dg.reshape(gate.shape), dw


def recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                   initial_state: Tensor | None, scale: float | None, lower_bound: float | None
                   ) -> tuple[Tensor, Tensor]:
    """fla's ``fused_recurrent_kda`` with the gate, the beta sigmoid and the q/k l2-norm in the kernel, K-first state:
    ``g`` the raw gate input, ``beta`` logits, ``initial_state`` fp32 ``[B, H, K, V]`` or ``None``. Returns
    ``(o [B, T, H, V] in q's dtype, final_state fp32 [B, H, K, V])``.
    """
    return tuple(checked(
        load(), "fused_recurrent_kda", q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
        initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, state_v_first=False)())
