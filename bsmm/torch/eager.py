"""Differentiation of the passes, in eager mode and under ``torch.compile``: one autograd function
per entry of the pass table (:data:`bsmm.passes.PASSES`), and one for the fused bias + activation.

Each function's backward applies the table's cotangents (every gradient of a pass is another
pass), through the functions themselves when a graph is being built (``create_graph``: gradients
of any order) and straight through the kernels otherwise. Its forward calls the kernels directly
on plain CPU and CUDA tensors in eager mode (:func:`bsmm.torch.passes.run_pass`: an autograd
function dispatches in a fraction of an operator's host time) and the operators of
:mod:`bsmm.torch.ops` anywhere else (``torch.compile`` traces the function and records the
operators, with no autograd layer of their own: :mod:`bsmm.torch.ops`; ``make_fx`` and other
dispatch modes, fake, meta and functorch tensors, tensor subclasses).

``torch.ops.bsmm.matmul``, ``matmul_bprop`` and ``matmul_updat`` are the three passes as
differentiable operators (``CompositeImplicitAutograd``: they decompose into these functions).
"""

from __future__ import annotations

import torch

from bsmm.epilogues import ACTIVATIONS
from bsmm.passes import PASSES, cotangent_operands
from bsmm.torch.ops import PASS_OPS, fprop_epilogue
from bsmm.torch.passes import run_epilogue, run_pass
from bsmm.torch.registry import live_registration

__all__ = ["FUNCTIONS", "FUSED_PRE_MAX_BYTES", "BiasAct", "biased_product", "keeps_pre_fused", "product"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors of no subclass (a layer's weight is a Parameter)
_EAGER_DEVICES = ("cpu", "cuda")  # (meta tensors take the operator's fake implementation)
# A TorchDispatchMode (make_fx tracing, FlopCounterMode, ...) sees the operators, not the kernels.
_dispatch_mode = torch.utils._python_dispatch._get_current_dispatch_mode
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", lambda: None)


def _eager(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernels may run on ``a`` and ``b`` directly (else: through the operators)."""
    return (a.__class__ in _PLAIN and b.__class__ in _PLAIN and a.device.type in _EAGER_DEVICES
            and not torch.compiler.is_compiling() and _functorch_level() is None and _dispatch_mode() is None
            and not torch.jit.is_tracing())


def _run(pass_name: str, a, b, key: str, feature_axis: int, tf32: bool, out_shape=None,
         eager: bool | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """One pass, undifferentiated: the kernels, or the operator where :func:`_eager` says so
    (``eager``: what the caller already knows of it); ``gate``: as :func:`bsmm.torch.passes.run_pass`'s."""
    if _eager(a, b) if eager is None else eager:
        return run_pass(pass_name, a, b, key, feature_axis, tf32, out_shape, gate)
    y = PASS_OPS[pass_name](a, b, key, feature_axis, tf32, gate)
    return y if out_shape is None else y.reshape(out_shape)


def _eager_with_bias(x, w, bias) -> bool:
    """:func:`_eager`, and a bias (if any) of no tensor subclass."""
    return _eager(x, w) and (bias is None or bias.__class__ in _PLAIN)


def _keep_registration(ctx, key: str) -> None:
    # Holding the registration keeps the key resolvable until backward, whatever the caller drops
    # meanwhile (a compiled graph holds only the key: the layer keeps it).
    if not torch.compiler.is_compiling():
        ctx.registration = live_registration(key)


def _check_registration(ctx, key: str) -> None:
    """Refuse a backward whose forward ran on another layout than ``key`` names now: a moving key
    (:func:`bsmm.torch.registry.move`, a layer's layout changed by :mod:`bsmm.torch.dynamic`) moved
    between them, so the backward would compute with blocks the forward never used."""
    held = getattr(ctx, "registration", None)
    if held is not None and (held.retired or live_registration(key) is not held):
        raise RuntimeError(f"the layout of {key!r} changed between this forward and its backward "
                           f"(bsmm.torch.dynamic.change_layout): change layouts only between training steps")


def _cotangents(ctx, pass_name: str, grad: torch.Tensor, operands: tuple, gate: torch.Tensor | None = None) -> list:
    """The gradients of a pass's two operands from its output's gradient (:attr:`BlockPass.cotangents`).
    ``gate``: the gates of the forward's weights (fprop, bprop), which the passes over those weights skip
    by, and updat too where ``ctx.updat_gate`` (the closed blocks' gradients are not read)."""
    _check_registration(ctx, ctx.options[0])
    differentiable = torch.is_grad_enabled()
    found = []
    for needed, rule in zip(ctx.needs_input_grad[:2], PASSES[pass_name].cotangents):
        if not needed:
            found.append(None)
            continue
        first, second = cotangent_operands(rule, operands, grad)
        if differentiable:  # create_graph: through the functions, so that this gradient has one too
            found.append(_apply(rule[0], first, second, *ctx.options, None, None, False))
        else:  # as the forward ran: the kernels in eager mode, the operators in a traced graph
            skip = gate if not PASSES[rule[0]].updates_weights or ctx.updat_gate else None
            found.append(_run(rule[0], first, second, *ctx.options, None, ctx.eager, skip))
    return found


def _weight_gate(pass_name: str, gate: torch.Tensor | None) -> torch.Tensor | None:
    """The gate a pass function keeps for its backward: fprop's and bprop's, whose second operand is
    the gated weight (an updat's operands are activations and gradients, which it does not describe)."""
    return None if PASSES[pass_name].updates_weights else gate


def _pass_function(pass_name: str) -> type:
    """The autograd function of one pass: ``apply(a, b, key, feature_axis, tf32, out_shape, gate,
    updat_gate, eager)`` (``gate``: the gates the weights are scaled by, a hint the kernels skip closed
    blocks by, or None; ``updat_gate``: the backward's updat may skip them too; ``eager``: :func:`_eager`
    of the operands, decided once by :func:`_apply`)."""

    def forward(a, b, key, feature_axis, tf32, out_shape, gate, updat_gate, eager):
        return _run(pass_name, a, b, key, feature_axis, tf32, out_shape, eager,
                    gate if not PASSES[pass_name].updates_weights or updat_gate else None)

    def setup_context(ctx, inputs, output):
        a, b, key, feature_axis, tf32, out_shape, gate, updat_gate, eager = inputs
        ctx.options, ctx.eager, ctx.updat_gate = (key, feature_axis, tf32), eager, updat_gate
        _keep_registration(ctx, key)
        # Each operand's gradient is a pass with the other operand only (a bilinear map).
        needs_a, needs_b = ctx.needs_input_grad[:2]
        ctx.save_for_backward(a if needs_b else None, b if needs_a else None, _weight_gate(pass_name, gate))
        # The output as the pass saw it (2-D), where the caller asked for leading dimensions.
        ctx.rows_shape = _rows_shape(out_shape, feature_axis)

    def backward(ctx, grad):
        # (an expanded or transposed view, from sum() or .T; of y's leading dimensions where it had some)
        grad = (grad if ctx.rows_shape is None else grad.reshape(ctx.rows_shape)).contiguous()
        a, b, gate = ctx.saved_tensors
        return (*_cotangents(ctx, pass_name, grad, (a, b), gate), None, None, None, None, None, None, None)

    methods = {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
               "backward": staticmethod(backward), "__doc__": f"The {pass_name} pass, differentiable in both operands."}
    return type(f"{pass_name.capitalize()}Function", (torch.autograd.Function,), methods)


def _rows_shape(out_shape: tuple | None, feature_axis: int) -> tuple | None:
    """The 2-D shape a pass gave an output of ``out_shape`` (leading, or trailing, dimensions folded)."""
    if out_shape is None:
        return None
    count = 1
    for size in out_shape:
        count *= size
    if feature_axis == 1:
        return (count // max(out_shape[-1], 1) if out_shape[-1] else 0, out_shape[-1])
    return (out_shape[0], count // max(out_shape[0], 1) if out_shape[0] else 0)


#: Pass name -> its autograd function.
FUNCTIONS = {name: _pass_function(name) for name in PASSES}

# ``Function.apply`` of a function with ``setup_context`` binds its arguments to the forward's
# signature through ``inspect`` on every call (for default arguments, which these have none
# of), then calls the C++ apply: 36 -> 6 µs a call measured on the CPU (results/). In eager mode
# on plain tensors the functions are applied through the C++ apply directly; anywhere else
# (torch.compile traces ``apply``, functorch transforms need its unwrapping) through ``apply``.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def _direct_apply(function: type):
    return _C_APPLY.__get__(None, function)


def _apply(name: str, a, b, *options, eager: bool | None = None):
    """The function of pass ``name`` (or ``"bias_act"``) applied to ``a``, ``b`` and ``options``, its
    last argument whether it runs eagerly (:func:`_eager`, computed here where not given)."""
    if eager is None:
        eager = _eager(a, b)
    return (_DIRECT[name] if eager else _FUNCTION_OF[name].apply)(a, b, *options, eager)


def _activation_grad(activation: str, grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """dz = grad · A'(z) with PyTorch's own backward kernels (differentiable themselves); ``saved``
    is y or z as :attr:`bsmm.epilogues.Activation.reads` says."""
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, saved, 0)
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, saved)
    return torch.ops.aten.gelu_backward(grad, saved, approximate="tanh" if activation == "gelu_tanh" else "none")


#: bsmm's activation names (but "none") -> PyTorch's function.
TORCH_ACTIVATIONS = {
    "relu": torch.nn.functional.relu,
    "gelu": lambda z: torch.nn.functional.gelu(z, approximate="none"),
    "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}
#: The same, differentiable twice (create_graph backwards): aten::silu_backward has no derivative of its own.
_TORCH_ACTIVATIONS = {**TORCH_ACTIVATIONS, "silu": lambda z: z * torch.sigmoid(z)}


def _differentiable_activation_grad(ctx, grad, x, w, bias) -> torch.Tensor:
    """dz = grad · A'(z) as a function of x, W and the bias, for a backward that builds a graph: z
    is recomputed through the differentiable product, so that dz carries A''(z) to the next order."""
    key, feature_axis, tf32 = ctx.options
    z = _apply("fprop", x, w, key, feature_axis, tf32, None, None, False)
    if bias is not None:
        z = z + (bias if feature_axis == 1 else bias.view(-1, 1))
    with torch.enable_grad():
        y = _TORCH_ACTIVATIONS[ctx.activation](z)
    return torch.autograd.grad(y, z, grad, create_graph=True)[0].contiguous()


class BiasAct(torch.autograd.Function):
    """y = A(x·W + bias) in one kernel (:mod:`bsmm.epilogues`), differentiable in x, W and bias.

    ``apply(x, w, bias or None, key, feature_axis, tf32, activation, keep_pre, out_shape, gate, updat_gate,
    eager) -> (y, pre)`` (``gate``, ``updat_gate``: as the pass functions'):
    ``pre`` is the pre-activation z where ``keep_pre`` (the backward of GELU and SiLU reads it:
    :func:`biased_product` asks for it), else an empty tensor. The backward turns the output's gradient into dz with PyTorch's own
    activation backward, then the bias gradient is dz summed over the batch and dx, dW the
    bprop and updat of dz.
    """

    @staticmethod
    def forward(x, w, bias, key, feature_axis, tf32, activation, keep_pre, out_shape, gate, updat_gate, eager):
        # (grad mode is off in here: whether a gradient will be taken is the caller's to say)
        return _run_epilogue(x, w, bias, key, feature_axis, tf32, activation, keep_pre, out_shape, eager, gate)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, bias, key, feature_axis, tf32, activation, keep_pre, out_shape, gate, updat_gate, eager = inputs
        ctx.updat_gate = updat_gate
        y, pre = output
        ctx.mark_non_differentiable(pre)
        # No zeros for pre's gradient: a tensor of y's size filled every step (80 µs at workload F).
        ctx.set_materialize_grads(False)
        ctx.options, ctx.eager = (key, feature_axis, tf32), eager
        ctx.activation, ctx.feature_axis = activation, feature_axis
        _keep_registration(ctx, key)
        ctx.rows_shape = _rows_shape(out_shape, feature_axis) or tuple(y.shape)
        # What A' reads: nothing for "none" (A' = 1: keeping y would hold an output-sized tensor through backward).
        saved = None if activation == "none" else y if ACTIVATIONS[activation].reads == "output" else pre
        # x and w both: a backward that builds a graph (create_graph) recomputes z from them.
        ctx.save_for_backward(x, w, bias, saved, gate)

    @staticmethod
    def backward(ctx, grad, _):
        if grad is None:  # (y was not used in the loss)
            return (None,) * 12
        x, w, bias, saved, gate = ctx.saved_tensors
        grad = grad.reshape(ctx.rows_shape).contiguous()
        if torch.is_grad_enabled() and ctx.activation != "none":
            dz = _differentiable_activation_grad(ctx, grad, x, w, bias)
        else:  # the kept z (or y) is a constant here: the first derivative needs no more
            dz = grad if saved is None else \
                _activation_grad(ctx.activation, grad, saved.reshape(ctx.rows_shape)).contiguous()
        dx, dw = _cotangents(ctx, "fprop", dz, (x, w), gate)
        dbias = None
        if ctx.needs_input_grad[2]:
            dbias = dz.sum(0 if ctx.feature_axis == 1 else 1)
        return dx, dw, dbias, None, None, None, None, None, None, None, None, None


def _run_epilogue(x, w, bias, key, feature_axis, tf32, activation, keep_pre, out_shape, eager=None, gate=None):
    if _eager_with_bias(x, w, bias) if eager is None else eager:
        return run_epilogue(x, w, bias, key, feature_axis, tf32, activation, keep_pre, out_shape, gate)
    y, pre = fprop_epilogue(x, w, bias, key, feature_axis, tf32, activation, keep_pre, gate)
    if out_shape is not None:
        y = y.reshape(out_shape)
        pre = pre.reshape(out_shape) if keep_pre else pre
    return y, pre


_FUNCTION_OF = {**FUNCTIONS, "bias_act": BiasAct}
_DIRECT = {name: _direct_apply(function) for name, function in _FUNCTION_OF.items()}


def product(x: torch.Tensor, w: torch.Tensor, key: str, feature_axis: int, tf32: bool,
            out_shape: tuple | None = None, gate: torch.Tensor | None = None, updat_gate: bool = False) -> torch.Tensor:
    """y = x·W, differentiable in both: ``x`` is 2-D; ``out_shape``, where given, is y's shape with
    the leading dimensions the caller flattened out of ``x`` (in eager mode y is then a tensor of
    that shape, not a view). Without a gradient to record, the pass runs as it is. ``gate``: the
    gates ``w`` is already scaled by (checked: :func:`bsmm.torch.functional.matmul_by_key`), whose
    closed blocks the kernels skip; ``updat_gate``: the weight gradient's pass may skip them too."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _apply("fprop", x, w, key, feature_axis, tf32, out_shape, gate, updat_gate)
    return _run("fprop", x, w, key, feature_axis, tf32, out_shape, None, gate)


def biased_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, key: str, feature_axis: int,
                   tf32: bool, activation: str, out_shape: tuple | None = None,
                   features_out: int = 0, gate: torch.Tensor | None = None, updat_gate: bool = False) -> torch.Tensor:
    """y = A(x·W + bias) through :class:`BiasAct` (``activation`` a name of
    :data:`bsmm.epilogues.ACTIVATIONS`, ``"none"`` for the bias alone; ``features_out``: the
    layer's K); as :func:`product` otherwise (``gate``, ``updat_gate`` too)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias)):
        keep_pre = ACTIVATIONS[activation].reads == "pre"
        rows = x.shape[0] if feature_axis == 1 else x.shape[1]
        if keep_pre and not keeps_pre_fused(rows, features_out, x.element_size()):
            # z from the kernel (with the bias), A by PyTorch: see keeps_pre_fused.
            z = biased_product(x, w, bias, key, feature_axis, tf32, "none", out_shape, features_out, gate, updat_gate)
            return _TORCH_ACTIVATIONS[activation](z)
        return _apply("bias_act", x, w, bias, key, feature_axis, tf32, activation, keep_pre, out_shape, gate,
                      updat_gate, eager=_eager_with_bias(x, w, bias))[0]
    return _run_epilogue(x, w, bias, key, feature_axis, tf32, activation, False, out_shape, None, gate)[0]


#: Output bytes up to which a training forward keeps z from the fused kernel (see keeps_pre_fused).
FUSED_PRE_MAX_BYTES = 32 << 20


def keeps_pre_fused(rows: int, features: int, item_bytes: int) -> bool:
    """Whether a training forward whose activation needs z (GELU, SiLU) writes y and z from one
    kernel, or writes z alone (bias in the kernel) and lets PyTorch apply the activation.

    The epilogue writes y and z as two streams of column-pair stores; where they exceed the L2
    (60 MB on an H200) the fprop took 915 µs against 410 µs for z alone at workload F's up
    projection (N 8192, 4096 -> 16384, block 128, 10 %, bf16), more than PyTorch's activation
    kernel saves (152 µs); at workload S (N 32, 12288 features) the fused step was faster.
    Fused up to :data:`FUSED_PRE_MAX_BYTES` of y and z together (the crossover between the two
    was not measured: ``results/v23/``)."""
    return 2 * rows * features * item_bytes <= FUSED_PRE_MAX_BYTES


# The public differentiable operators: decomposed (CompositeImplicitAutograd) into the functions.
_PUBLIC = torch.library.Library("bsmm", "FRAGMENT")
for _name, _public in (("fprop", "matmul"), ("bprop", "matmul_bprop"), ("updat", "matmul_updat")):
    _first, _second = PASSES[_name].operands
    _PUBLIC.define(f"{_public}(Tensor {_first}, Tensor {_second}, str key, int feature_axis, bool tf32) -> Tensor")
    _PUBLIC.impl(_public, lambda a, b, key, feature_axis, tf32, _pass=_name:
                 _apply(_pass, a, b, key, feature_axis, tf32, None, None, False), "CompositeImplicitAutograd")
