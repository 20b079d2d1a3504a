"""Torch regions with data-dependent control flow as ``torch.library`` custom ops, for ``torch.compile``, and the
package's autocast helpers.

:func:`recompute_op` and :func:`module_op` register a function (or a module called as a whole) as an opaque op with a
fake implementation and a recomputing backward; eager code calls the function directly (:func:`in_graph`). Source:
PyTorch's "Custom Python operators" guide (``torch.library.custom_op``, ``register_fake``, ``register_autograd``,
``register_autocast``).

Autocast (``torch.autocast``, mixed precision; the policy is in ``docs/design.md``, "Mixed precision"): every op these
helpers register gets an autocast kernel on CPU and CUDA, so autocast never reaches inside an op's implementation
(where it would cast the forward's matmuls but not its backward's): a :func:`define_op` op and every backward op run
with autocast off on the dtypes they are given; a :func:`recompute_op` / :func:`module_op` forward op records the
caller's autocast dtype in its ``amp`` argument and runs (and its backward recomputes) under that autocast, as the
eager function it stands for. :func:`autocast_off` / :func:`no_autocast` mark the package's fp32 regions and
:func:`to_autocast_dtype` the matmuls outside ``nn.Linear`` that follow autocast.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import weakref
from collections.abc import Callable, Sequence

import torch

NAMESPACE = "glm53flash"

__all__ = ["NAMESPACE", "autocast_dtype", "autocast_off", "define_op", "in_graph", "module_op", "module_parameters",
           "no_autocast", "no_output", "recompute_op", "register_module", "to_autocast_dtype"]

# device types whose autocast the registered ops handle (torch.amp.is_autocast_available)
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def autocast_dtype(like: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts to on ``like``'s device type (bf16 on CPU by default, fp16 or bf16 on
    CUDA), or ``None`` where autocast is off (or unavailable) for that device type."""
    device_type = like.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_off(like: torch.Tensor):
    """A context manager with autocast disabled on ``like``'s device type (a no-op context where it is off): the
    ops inside compute in the dtypes they are given, as without autocast (the package's fp32 regions)."""
    if autocast_dtype(like) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=like.device.type, enabled=False)


def _first_tensor(values) -> torch.Tensor | None:
    for v in values:
        found = _first_tensor(v) if isinstance(v, (list, tuple)) else v
        if isinstance(found, torch.Tensor):
            return found
    return None


def no_autocast(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs under :func:`autocast_off` of its first tensor argument (searched in order, into lists
    and tuples; none: ``fn`` runs as called). For the ``forward`` *and* ``backward`` of a ``torch.autograd.Function``
    that computes in its own dtypes: its backward then runs without autocast also when ``.backward()`` is called
    inside an autocast region, the policy of its forward (what ``torch.amp.custom_fwd`` / ``custom_bwd`` do for one
    fixed device type)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        like = _first_tensor((*args, *kwargs.values()))
        if like is None:
            return fn(*args, **kwargs)
        with autocast_off(like):
            return fn(*args, **kwargs)

    return run


def to_autocast_dtype(*tensors: torch.Tensor | None) -> tuple:
    """``tensors`` with the floating ones (not fp64) cast to :func:`autocast_dtype` of their device type where
    autocast is on there (others, ``None`` and all of them with autocast off: unchanged), as autocast casts the
    operands of ``F.linear``: for matmuls autocast does not see (``grouped_mm`` on CPU, the FP8 fallback's tiles).
    Differentiable (the gradient is cast back to each input's dtype)."""
    out = []
    for t in tensors:
        dtype = autocast_dtype(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else None
        out.append(t.to(dtype) if dtype is not None and t.dtype != torch.float64 else t)
    return tuple(out)


# The autocast kernels of the ops registered here (one library object per process and copy of this module: a kernel
# is registered once, when its op is created).
_AUTOCAST_LIB = torch.library.Library(NAMESPACE, "IMPL")


def _register_autocast(name: str, amp_arg: str | None = None) -> None:
    """Register the autocast kernels (CPU and CUDA) of ``glm53flash::<name>``: the op runs with that device type's
    autocast excluded, on its inputs as given; with ``amp_arg``, that string argument is first set to the caller's
    autocast dtype (``"bfloat16"``, ``"float16"``), which the op's implementation re-enters (module docstring)."""
    overload = getattr(getattr(torch.ops, NAMESPACE), name).default
    for device_type in AUTOCAST_DEVICE_TYPES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _excluded=excluded, **kwargs):
            if amp_arg is not None:
                kwargs[amp_arg] = str(torch.get_autocast_dtype(_device_type)).removeprefix("torch.")
            with torch._C._ExcludeDispatchKeyGuard(_excluded):
                return overload(*args, **kwargs)

        _AUTOCAST_LIB.impl(name, kernel, key, with_keyset=True)


def _replayed_autocast(like: torch.Tensor, amp: str):
    """The autocast a :func:`recompute_op` / :func:`module_op` implementation re-enters: ``amp`` (a dtype name set by
    its autocast kernel) on ``like``'s device type, or a no-op context for ``amp == ""`` (called without autocast)."""
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=like.device.type, dtype=getattr(torch, amp))


def define_op(name: str, impl, fake, *, backward=None, setup_context=None):
    """Register ``impl`` as ``glm53flash::<name>`` with its ``fake`` implementation and optional autograd formula
    (``backward``, ``setup_context`` as ``torch.library.register_autograd``); returns the op, or the existing op of
    that name. ``impl`` annotates every argument and the return, a tensor or tuple of tensors that are not inputs.

    Under autocast the op and its autograd formula run with autocast off (module docstring): ``impl`` computes in the
    dtypes it is given, forward and backward alike."""
    existing = getattr(torch.ops, NAMESPACE)
    if hasattr(existing, name):
        return getattr(existing, name)
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(no_autocast(backward), setup_context=setup_context)
    _register_autocast(name)
    return op


def in_graph() -> bool:
    """True while ``torch.compile`` traces (dynamo or export): data-dependent regions must go through their op."""
    return torch.compiler.is_compiling()


def no_output(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an op returns for an output that does not exist (custom ops return no ``None``)."""
    return like.new_empty(0)


@contextlib.contextmanager
def _autograd_recording():
    """Grad mode on and the autograd dispatch keys re-enabled (excluded inside a custom op's implementation)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    keys = torch._C.DispatchKey
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def recompute_op(name: str, fn: Callable[..., tuple], tensor_args: Sequence[tuple[str, bool]],
                 static_args: Sequence[tuple[str, str]], num_outputs: int, fake: Callable[..., tuple]
                 ) -> Callable[..., tuple]:
    """Register ``fn`` as ``glm53flash::<name>`` (and ``<name>_backward``) with a recomputing backward; returns the op.

    Args:
        fn: pure ``fn(*tensors, **statics)`` returning ``num_outputs`` tensors or ``None`` (returned empty).
        tensor_args: ``(name, optional)`` per positional tensor; floating ones that require grad get gradients.
        static_args: ``(name, schema type)`` per keyword argument, e.g. ``("scale", "float")``.
        fake: ``fake(*tensors, **statics)`` giving the outputs' shapes and dtypes (called under the same autocast as
            ``fn``: :func:`autocast_dtype` tells a fake whose output dtype follows autocast).

    Under autocast the op runs ``fn`` (and its backward recomputes it) under the caller's autocast, recorded in the
    op's keyword-only argument ``amp`` (module docstring): compiled as eager.
    """
    existing = getattr(torch.ops, NAMESPACE)
    if hasattr(existing, name):  # a second copy of the module (remote code): share the first registration
        return getattr(existing, name)
    tensor_names = [n for n, _ in tensor_args]
    static_names = [n for n, _ in static_args]
    tensor_schema = ", ".join(f"Tensor{'?' if opt else ''} {n}" for n, opt in tensor_args)
    static_schema = ", ".join(f"{t} {n}" for n, t in static_args)
    outputs_schema = "(" + ", ".join(["Tensor"] * num_outputs) + ")"
    args_schema = ", ".join(s for s in (tensor_schema, static_schema) if s)
    amp_schema = '*, str amp=""'

    def split(args):
        """``(tensors, statics, the first tensor given)`` of an op's positional arguments."""
        tensors = list(args[: len(tensor_names)])
        return tensors, dict(zip(static_names, args[len(tensor_names) :])), next(t for t in tensors if t is not None)

    def forward_impl(*args, amp=""):
        tensors, statics, like = split(args)
        with _replayed_autocast(like, amp):
            outs = fn(*tensors, **statics)
        return tuple(no_output(like) if o is None else o.contiguous() for o in outs)

    forward = torch.library.custom_op(
        f"{NAMESPACE}::{name}", forward_impl, mutates_args=(),
        schema=f"({', '.join(s for s in (args_schema, amp_schema) if s)}) -> {outputs_schema}",
    )

    @forward.register_fake
    def _(*args, amp=""):
        tensors, statics, like = split(args)
        with _replayed_autocast(like, amp):
            return tuple(fake(*tensors, **statics))

    def backward_impl(grads, needs, *args, amp=""):
        tensors, statics, like = split(args)
        inputs = [t.detach().requires_grad_() if t is not None and need else t for t, need in zip(tensors, needs)]
        with _autograd_recording(), _replayed_autocast(like, amp):
            outs = fn(*inputs, **statics)
            pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and o.requires_grad
                     and g.numel() == o.numel()]
            wanted = [t for t, need in zip(inputs, needs) if t is not None and need]
            found = [None] * len(wanted)
            if pairs and wanted:
                found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        result, it = [], iter(found)
        for t, need in zip(tensors, needs):
            g = next(it) if t is not None and need else None
            if g is None:
                g = torch.zeros_like(t) if t is not None and need else no_output(like)
            result.append(g.contiguous())
        return result

    backward = torch.library.custom_op(
        f"{NAMESPACE}::{name}_backward", backward_impl, mutates_args=(),
        schema=f"(Tensor[] grads, bool[] needs, {args_schema}, {amp_schema}) -> Tensor[]",
    )

    @backward.register_fake
    def _(grads, needs, *args, amp=""):
        tensors, _, like = split(args)
        return [t.new_empty(t.shape) if t is not None and need else no_output(like) for t, need in zip(tensors, needs)]

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        ctx.statics = inputs[len(tensor_names) :]
        ctx.amp = keyword_only_inputs.get("amp", "")
        ctx.save_for_backward(*inputs[: len(tensor_names)])

    @no_autocast
    def autograd_backward(ctx, *grads):
        tensors = list(ctx.saved_tensors)
        needs = [bool(need) and t is not None and t.dtype.is_floating_point
                 for t, need in zip(tensors, ctx.needs_input_grad[: len(tensor_names)])]
        if not any(needs):
            return tuple(None for _ in range(len(tensors) + len(ctx.statics)))
        like = next(t for t in tensors if t is not None)
        grads = [g if g is not None else no_output(like) for g in grads]
        result = backward(grads, needs, *tensors, *ctx.statics, amp=ctx.amp)
        return tuple(r if need else None for r, need in zip(result, needs)) + tuple(None for _ in ctx.statics)

    forward.register_autograd(autograd_backward, setup_context=setup_context)
    _register_autocast(name, amp_arg="amp")
    _register_autocast(f"{name}_backward")
    return forward


# One registry per process, shared by every copy of this module (the package and its files loaded as remote code):
# the op registered first reads it.
_MODULES: dict[int, tuple] = sys.modules.setdefault(
    "glm53flash_op_modules", types.SimpleNamespace(registry={})  # type: ignore[arg-type]
).registry


def register_module(module: torch.nn.Module) -> int:
    """Make ``module`` reachable from a :func:`module_op` by an integer key (its ``id``); returns the key."""
    key = id(module)
    entry = _MODULES.get(key)
    if entry is None or entry[0]() is not module:
        _MODULES[key] = (weakref.ref(module), [n for n, _ in module.named_parameters()])
    return key


def module_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters in the order :func:`module_op` expects them."""
    return [p for _, p in module.named_parameters()]


def module_op(name: str, call: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> Callable:
    """Register ``call(module, x, aux)`` (one tensor out) as the custom op ``glm53flash::<name>``, differentiable in
    ``x`` and the module's parameters, with a recomputing backward.

    Call the op as ``op(x, aux, module_parameters(module), register_module(module))``; ``aux`` is a
    non-differentiable tensor; ``fake(module, x, aux)`` gives the output's shape, in ``x.dtype``: the op returns
    ``call``'s output cast to ``x.dtype`` (under autocast, where ``call`` runs under the caller's autocast recorded in
    the keyword-only ``amp`` as in :func:`recompute_op`, that is the cast a consumer in ``x.dtype`` makes anyway).
    """

    existing = getattr(torch.ops, NAMESPACE)
    if hasattr(existing, name):  # a second copy of the module (remote code): share the first registration
        return getattr(existing, name)

    def run(x, aux, params, key, amp):
        ref, names = _MODULES[key]
        module = ref()
        with _replayed_autocast(x, amp):
            out = call(lambda *a, **k: torch.func.functional_call(module, dict(zip(names, params)), a, k), x, aux)
        return out.to(x.dtype)

    schema = '(Tensor x, Tensor aux, Tensor[] params, int key, *, str amp="")'
    forward = torch.library.custom_op(
        f"{NAMESPACE}::{name}", lambda x, aux, params, key, amp="": run(x, aux, params, key, amp).contiguous(),
        mutates_args=(), schema=f"{schema} -> Tensor",
    )
    forward.register_fake(lambda x, aux, params, key, amp="": fake(_MODULES[key][0](), x, aux))

    def backward_impl(grad, needs, x, aux, params, key, amp=""):
        inputs = [t.detach().requires_grad_(need) for t, need in zip([x, *params], needs)]
        with _autograd_recording():
            out = run(inputs[0], aux, inputs[1:], key, amp)
            wanted = [t for t, need in zip(inputs, needs) if need]
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        result = []
        for t, need in zip(inputs, needs):
            g = next(found) if need else None
            result.append((torch.zeros_like(t) if g is None else g).contiguous() if need else no_output(x))
        return result

    backward = torch.library.custom_op(
        f"{NAMESPACE}::{name}_backward", backward_impl, mutates_args=(),
        schema='(Tensor grad, bool[] needs, Tensor x, Tensor aux, Tensor[] params, int key, *, str amp="") -> Tensor[]',
    )
    backward.register_fake(lambda grad, needs, x, aux, params, key, amp="": [
        t.new_empty(t.shape) if need else no_output(x) for t, need in zip([x, *params], needs)])

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        x, aux, params, ctx.key = inputs
        ctx.amp = keyword_only_inputs.get("amp", "")
        ctx.save_for_backward(x, aux, *params)

    @no_autocast
    def autograd_backward(ctx, grad):
        x, aux, *params = ctx.saved_tensors
        need_x, _, need_params, _ = ctx.needs_input_grad
        needs = [bool(need_x) and x.dtype.is_floating_point] + [bool(n) for n in need_params]
        if not any(needs):
            return None, None, [None] * len(params), None
        result = backward(grad, needs, x, aux, params, ctx.key, amp=ctx.amp)
        grads = [r if need else None for r, need in zip(result, needs)]
        return grads[0], None, grads[1:], None

    forward.register_autograd(autograd_backward, setup_context=setup_context)
    _register_autocast(name, amp_arg="amp")
    _register_autocast(f"{name}_backward")
    return forward
