"""Torch regions with data-dependent control flow as ``torch.library`` custom ops, for ``torch.compile``.

:func:`recompute_op` and :func:`module_op` register a function (or a module called as a whole) as an opaque op with a
fake implementation and a recomputing backward; eager code calls the function directly (:func:`in_graph`). Source:
PyTorch's "Custom Python operators" guide (``torch.library.custom_op``, ``register_fake``, ``register_autograd``).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Sequence

import torch

NAMESPACE = "glm53flash"

__all__ = ["NAMESPACE", "define_op", "in_graph", "module_op", "module_parameters", "no_output", "recompute_op",
           "register_module"]


def define_op(name: str, impl, fake, *, backward=None, setup_context=None):
    """Register ``impl`` as ``glm53flash::<name>`` with its ``fake`` implementation and optional autograd formula
    (``backward``, ``setup_context`` as ``torch.library.register_autograd``); returns the op, or the existing op of
    that name. ``impl`` annotates every argument and the return, a tensor or tuple of tensors that are not inputs."""
    existing = getattr(torch.ops, NAMESPACE)
    if hasattr(existing, name):
        return getattr(existing, name)
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
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


def recompute_op(
    name: str,
    fn: Callable[..., tuple],
    tensor_args: Sequence[tuple[str, bool]],
    static_args: Sequence[tuple[str, str]],
    num_outputs: int,
    fake: Callable[..., tuple],
) -> Callable[..., tuple]:
    """Register ``fn`` as ``glm53flash::<name>`` (and ``<name>_backward``) with a recomputing backward; returns the op.

    Args:
        fn: pure ``fn(*tensors, **statics)`` returning ``num_outputs`` tensors or ``None`` (returned empty).
        tensor_args: ``(name, optional)`` per positional tensor; floating ones that require grad get gradients.
        static_args: ``(name, schema type)`` per keyword argument, e.g. ``("scale", "float")``.
        fake: ``fake(*tensors, **statics)`` giving the outputs' shapes and dtypes.
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

    def split(args):
        return list(args[: len(tensor_names)]), dict(zip(static_names, args[len(tensor_names) :]))

    def forward_impl(*args):
        tensors, statics = split(args)
        outs = fn(*tensors, **statics)
        like = next(t for t in tensors if t is not None)
        return tuple(no_output(like) if o is None else o.contiguous() for o in outs)

    forward = torch.library.custom_op(
        f"{NAMESPACE}::{name}", forward_impl, mutates_args=(), schema=f"({args_schema}) -> {outputs_schema}"
    )

    @forward.register_fake
    def _(*args):
        tensors, statics = split(args)
        return tuple(fake(*tensors, **statics))

    def backward_impl(grads, needs, *args):
        tensors, statics = split(args)
        inputs = [t.detach().requires_grad_() if t is not None and need else t for t, need in zip(tensors, needs)]
        with _autograd_recording():
            outs = fn(*inputs, **statics)
            pairs = [
                (o, g) for o, g in zip(outs, grads) if o is not None and o.requires_grad and g.numel() == o.numel()
            ]
            wanted = [t for t, need in zip(inputs, needs) if t is not None and need]
            found = (
                torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                if pairs and wanted
                else [None] * len(wanted)
            )
        like = next(t for t in tensors if t is not None)
        result, it = [], iter(found)
        for t, need in zip(tensors, needs):
            g = next(it) if t is not None and need else None
            if g is None:
                g = torch.zeros_like(t) if t is not None and need else no_output(like)
            result.append(g.contiguous())
        return result

    backward = torch.library.custom_op(
        f"{NAMESPACE}::{name}_backward",
        backward_impl,
        mutates_args=(),
        schema=f"(Tensor[] grads, bool[] needs, {args_schema}) -> Tensor[]",
    )

    @backward.register_fake
    def _(grads, needs, *args):
        tensors, _ = split(args)
        like = next(t for t in tensors if t is not None)
        return [t.new_empty(t.shape) if t is not None and need else no_output(like) for t, need in zip(tensors, needs)]

    def setup_context(ctx, inputs, output):
        ctx.statics = inputs[len(tensor_names) :]
        ctx.save_for_backward(*inputs[: len(tensor_names)])

    def autograd_backward(ctx, *grads):
        tensors = list(ctx.saved_tensors)
        needs = [
            bool(need) and t is not None and t.dtype.is_floating_point
            for t, need in zip(tensors, ctx.needs_input_grad[: len(tensor_names)])
        ]
        if not any(needs):
            return tuple(None for _ in range(len(tensors) + len(ctx.statics)))
        like = next(t for t in tensors if t is not None)
        grads = [g if g is not None else no_output(like) for g in grads]
        result = backward(grads, needs, *tensors, *ctx.statics)
        return tuple(r if need else None for r, need in zip(result, needs)) + tuple(None for _ in ctx.statics)

    forward.register_autograd(autograd_backward, setup_context=setup_context)
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
        import weakref

        _MODULES[key] = (weakref.ref(module), [n for n, _ in module.named_parameters()])
    return key


def module_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters in the order :func:`module_op` expects them."""
    return [p for _, p in module.named_parameters()]


def module_op(name: str, call: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> Callable:
    """Register ``call(module, x, aux)`` (one tensor out) as the custom op ``glm53flash::<name>``, differentiable in
    ``x`` and the module's parameters, with a recomputing backward.

    Call the op as ``op(x, aux, module_parameters(module), register_module(module))``; ``aux`` is a
    non-differentiable tensor; ``fake(module, x, aux)`` gives the output's shape and dtype.
    """

    existing = getattr(torch.ops, NAMESPACE)
    if hasattr(existing, name):  # a second copy of the module (remote code): share the first registration
        return getattr(existing, name)

    def run(x, aux, params, key):
        module, names = _MODULES[key]
        module = module()
        return call(lambda *a, **k: torch.func.functional_call(module, dict(zip(names, params)), a, k), x, aux)

    schema = "(Tensor x, Tensor aux, Tensor[] params, int key)"
    forward = torch.library.custom_op(
        f"{NAMESPACE}::{name}", lambda x, aux, params, key: run(x, aux, params, key).contiguous(), mutates_args=(),
        schema=f"{schema} -> Tensor",
    )
    forward.register_fake(lambda x, aux, params, key: fake(_MODULES[key][0](), x, aux))

    def backward_impl(grad, needs, x, aux, params, key):
        inputs = [t.detach().requires_grad_(need) for t, need in zip([x, *params], needs)]
        with _autograd_recording():
            out = run(inputs[0], aux, inputs[1:], key)
            wanted = [t for t, need in zip(inputs, needs) if need]
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        result = []
        for t, need in zip(inputs, needs):
            g = next(found) if need else None
            result.append((torch.zeros_like(t) if g is None else g).contiguous() if need else no_output(x))
        return result

    backward = torch.library.custom_op(
        f"{NAMESPACE}::{name}_backward", backward_impl, mutates_args=(),
        schema="(Tensor grad, bool[] needs, Tensor x, Tensor aux, Tensor[] params, int key) -> Tensor[]",
    )
    backward.register_fake(
        lambda grad, needs, x, aux, params, key: [
            t.new_empty(t.shape) if need else no_output(x) for t, need in zip([x, *params], needs)
        ]
    )

    def setup_context(ctx, inputs, output):
        x, aux, params, key = inputs
        ctx.key = key
        ctx.save_for_backward(x, aux, *params)

    def autograd_backward(ctx, grad):
        x, aux, *params = ctx.saved_tensors
        need_x, _, need_params, _ = ctx.needs_input_grad
        needs = [bool(need_x) and x.dtype.is_floating_point] + [bool(n) for n in need_params]
        if not any(needs):
            return None, None, [None] * len(params), None
        result = backward(grad, needs, x, aux, params, ctx.key)
        grads = [r if need else None for r, need in zip(result, needs)]
        return grads[0], None, grads[1:], None

    forward.register_autograd(autograd_backward, setup_context=setup_context)
    return forward
