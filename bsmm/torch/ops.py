"""The three passes as PyTorch custom operators: ``bsmm::matmul``, ``bsmm::matmul_bprop``, ``bsmm::matmul_updat``.

Layer one of :mod:`bsmm.torch`: operators that take tensors and plain values
only, each with a fake (shape-only) implementation for ``torch.compile`` and an
autograd formula written with the other two, so gradients of any order stay
block-sparse:

- ``matmul(x, w)``: y = x·W; dx = matmul_bprop(g, w), dw = matmul_updat(x, g).
- ``matmul_bprop(dy, w)``: dx = dy·Wᵀ; d(dy) = matmul(g, w), dw = matmul_updat(g, dy).
- ``matmul_updat(x, dy)``: dW = xᵀ·dy on the present blocks; dx = matmul_bprop(dy, g), d(dy) = matmul(x, g).

(``g`` is the upstream gradient; all take ``key, feature_axis, tf32`` after the tensors.)
The convolutions of :class:`bsmm.nn.conv.BlocksparseConv`, ``bsmm::conv_fprop``,
``bsmm::conv_bprop`` and ``bsmm::conv_updat`` (:mod:`bsmm.torch.conv_ops`), have the same structure and take
``key, spec, tf32``, ``spec`` being the geometry and the input's spatial shape as ints
(:func:`conv_spec`).

**How an operator finds its layout.** A custom operator's arguments are
tensors and primitives, so the layout travels as a string *key*: block rows x
block columns / block size / SHA-256 of the packed layout. It is derived from the
layout's content, not from an object's id or a counter, because
``torch.compile`` bakes the key into graphs it may cache on disk and reload in
another process: there the same string must name the same layout. The key
resolves through a process-wide registry of :class:`Registration` objects held
weakly; whoever needs a layout (a ``BlockSparseLinear``, a ``BlocksparseMatMul``
used through :func:`bsmm.torch.blocksparse_matmul`, a pending backward) holds
its ``Registration``, so an entry lives exactly as long as something can call
an operator with its key. Nothing about the registry is pickled: the layout
itself is, and unpickling registers it again.

**Devices.** CPU tensors are shared with the CPU backend as NumPy arrays,
CUDA tensors with the GPU kernels as CuPy arrays, both through DLPack without a
copy (bfloat16 passes as an int16 view, which DLPack expresses for NumPy).
float64 runs on the CPU only (computed in float64, for ``torch.autograd.gradcheck``);
float64 CUDA tensors are refused with a ``TypeError``.
On CUDA the kernels run on PyTorch's current stream of the tensors' device.
The only memory a pass takes from PyTorch is its output, from ``torch.empty``
(so the caching allocator owns it).
"""

from __future__ import annotations

import hashlib
import threading
import weakref

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("bsmm.torch needs PyTorch: pip install torch") from error

from bsmm.backends.cuda import launches
from bsmm.block_index import BlockIndex, block_index
from bsmm.matmul import BlocksparseMatMul

__all__ = ["Registration", "register", "lookup", "registration", "matmul", "matmul_bprop", "matmul_updat", "product",
           "run_pass", "check_dtype", "check_like", "check_contiguous", "into_new", "register_bilinear"]

#: torch dtypes bsmm runs on every device, by the names bsmm.dtypes uses.
SUPPORTED_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: torch dtypes bsmm runs on the CPU only (float64: for gradcheck).
CPU_ONLY_DTYPES = {torch.float64: "float64"}


# -- the layout registry ---------------------------------------------------------------------------------
class Registration:
    """Keeps one layout reachable from custom operators under :attr:`key` while referenced.

    Attributes
    ----------
    key : str
        ``"{CB}x{KB}/{block_size}/{sha256 of the packed layout}"``.
    index : BlockIndex
    """

    __slots__ = ("key", "index", "_operators", "__weakref__")

    def __init__(self, key: str, index: BlockIndex):
        self.key, self.index = key, index
        self._operators = {}

    def operator(self, signature: tuple, build):
        """``build(index)``, kept per ``signature`` while the layout is registered: the custom
        operators then reuse one operator's caches (launch plans, repeat calls, a
        convolution's row maps and stacked layouts) instead of rebuilding them every call."""
        op = self._operators.get(signature)
        if op is None:
            op = self._operators[signature] = build(self.index)
        return op

    def __reduce__(self):
        # Only the layout travels; unpickling registers it in the loading process's registry.
        return (_register_layout, (np.array(self.index.layout), self.index.block_size))

    def __repr__(self) -> str:
        return f"Registration({self.key!r})"


_REGISTRY: "weakref.WeakValueDictionary[str, Registration]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def layout_key(index: BlockIndex) -> str:
    """The content-derived key of a layout (see the module docstring)."""
    digest = hashlib.sha256(np.packbits(index.layout).tobytes()).hexdigest()
    return f"{index.n_block_rows}x{index.n_block_cols}/{index.block_size}/{digest}"


def register(index: BlockIndex) -> Registration:
    """Make ``index`` reachable by its key; hold the result as long as operators may use the key.

    Registering an equal layout twice returns the live ``Registration`` of the first.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> registration = register(bsmm.block_index(np.eye(2), block_size=8))
    >>> registration.key[:5], lookup(registration.key) is registration.index
    ('2x2/8', True)
    """
    key = layout_key(index)
    with _LOCK:
        registration = _REGISTRY.get(key)
        if registration is None:
            registration = _REGISTRY[key] = Registration(key, index)
    return registration


def _register_layout(layout: np.ndarray, block_size: int) -> Registration:
    return register(block_index(layout, block_size))


def lookup(key: str) -> BlockIndex:
    """The layout registered under ``key``.

    Raises
    ------
    ValueError
        If nothing holds a registration of ``key`` in this process.
    """
    return registration(key).index


def registration(key: str) -> Registration:
    registration = _REGISTRY.get(key)
    if registration is None:
        raise ValueError(
            f"key {key!r} names no layout registered in this process: the BlockSparseLinear or "
            f"BlocksparseMatMul that registered it is gone, or the key comes from another process "
            f"(build the layer or call bsmm.torch.register first)"
        )
    return registration


# -- checks, on real and on fake tensors -------------------------------------------------------------------
def check_dtype(dtype: torch.dtype, device: torch.device, argument: str) -> None:
    """Raise naming ``argument`` unless bsmm runs ``dtype`` on ``device`` (float64: the CPU only)."""
    if dtype in SUPPORTED_DTYPES or (dtype in CPU_ONLY_DTYPES and device.type == "cpu"):
        return
    supported = ", ".join(SUPPORTED_DTYPES.values())
    if dtype in CPU_ONLY_DTYPES:
        raise TypeError(
            f"{argument} has dtype {dtype}, which bsmm runs only on the CPU; on {device} supported dtypes are "
            f"{supported}"
        )
    raise TypeError(
        f"{argument} has dtype {dtype}; supported dtypes are {supported}, and "
        f"{', '.join(CPU_ONLY_DTYPES.values())} on the CPU"
    )


def check_like(tensor: torch.Tensor, argument: str, reference: torch.Tensor, reference_name: str) -> None:
    if tensor.device != reference.device:
        raise ValueError(
            f"{argument} is on {tensor.device} but {reference_name} is on {reference.device}; move them to one device"
        )
    if tensor.dtype != reference.dtype:
        raise TypeError(
            f"{argument} has dtype {tensor.dtype} but {reference_name} has {reference.dtype}; pass one dtype"
        )


def check_contiguous(tensor: torch.Tensor, argument: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{argument} must be contiguous; got shape {tuple(tensor.shape)}, strides {tensor.stride()}")


def _check_activation(tensor: torch.Tensor, argument: str, features: int, feature_axis: int):
    """Return N, or raise naming ``argument``."""
    if tensor.dim() != 2 or tensor.shape[feature_axis] != features:
        expected = f"(N, {features})" if feature_axis == 1 else f"({features}, N)"
        raise ValueError(
            f"{argument} must have shape {expected} with feature_axis={feature_axis}; got {tuple(tensor.shape)}"
        )
    check_contiguous(tensor, argument)
    return tensor.shape[1 - feature_axis]


def _check_weights(tensor: torch.Tensor, argument: str, index: BlockIndex) -> None:
    if tuple(tensor.shape) != index.w_shape:
        raise ValueError(f"{argument} must have shape w_shape {index.w_shape}; got {tuple(tensor.shape)}")
    check_contiguous(tensor, argument)


def _check_feature_axis(feature_axis: int) -> None:
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis must be 0 or 1; got {feature_axis!r}")


def _activation_shape(n, features: int, feature_axis: int) -> tuple:
    return (n, features) if feature_axis == 1 else (features, n)


def _product_shape(a, w, key, feature_axis, pass_name: str) -> tuple:
    """Output shape of fprop (``a`` is x (N, C)) or bprop (``a`` is dy (N, K)), or raise naming the argument."""
    index = lookup(key)
    name, features_in, features_out = ("x", index.C, index.K) if pass_name == "fprop" else ("dy", index.K, index.C)
    _check_feature_axis(feature_axis)
    check_dtype(a.dtype, a.device, name)
    check_like(w, "w", a, name)
    n = _check_activation(a, name, features_in, feature_axis)
    _check_weights(w, "w", index)
    return _activation_shape(n, features_out, feature_axis)


def _updat_shape(x, dy, key, feature_axis) -> tuple:
    index = lookup(key)
    _check_feature_axis(feature_axis)
    check_dtype(x.dtype, x.device, "x")
    check_like(dy, "dy", x, "x")
    n = _check_activation(x, "x", index.C, feature_axis)
    n_dy = _check_activation(dy, "dy", index.K, feature_axis)
    if n_dy != n:
        raise ValueError(f"dy has N = {n_dy} but x has N = {n}; they must match")
    return index.w_shape


# -- running a pass on real tensors ----------------------------------------------------------------------
def _shared_as(module, tensor: torch.Tensor):
    """``tensor``'s memory as a NumPy or CuPy array, without a copy."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        # DLPack's bfloat16 code is unknown to NumPy: share the bits as int16, then relabel them.
        return module.from_dlpack(tensor.view(torch.int16)).view(ml_dtypes.bfloat16)
    return module.from_dlpack(tensor)


#: (device, stream pointer) -> CuPy stream object; PyTorch pools its streams and never destroys them.
_CUPY_STREAMS: dict = {}


def _cupy_stream(cupy, device_index: int, ptr: int):
    """PyTorch's stream ``ptr`` as a CuPy stream (CuPy 14 deprecates ExternalStream for from_external)."""
    if ptr == 0:
        return cupy.cuda.Stream.null  # PyTorch's default stream is the legacy default stream
    stream = _CUPY_STREAMS.get((device_index, ptr))
    if stream is None:
        if hasattr(cupy.cuda.Stream, "from_external"):
            stream = cupy.cuda.Stream.from_external(launches.StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, device_index)
        _CUPY_STREAMS[(device_index, ptr)] = stream
    return stream


def _matmul_operator(key: str, feature_axis: int, tf32: bool) -> BlocksparseMatMul:
    return registration(key).operator(("matmul", feature_axis, tf32),
                                       lambda index: BlocksparseMatMul.from_index(index, feature_axis, tf32))


def run_pass(pass_name: str, a: torch.Tensor, b: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """One pass (``fprop``: a = x, b = w; ``bprop``: dy, w; ``updat``: x, dy) into a new tensor.

    A CUDA pass the operator has run before for this shape, dtype and device is repeated on raw
    pointers (:func:`_repeat_on_cuda`): no DLPack exchange, no re-validation beyond what could
    differ, the output from ``torch.empty``, one launch. Anything else takes the checked path.
    """
    return _run_on(_matmul_operator(key, feature_axis, tf32), pass_name, a, b, key)


def _run_on(op: BlocksparseMatMul, pass_name: str, a: torch.Tensor, b: torch.Tensor, key: str) -> torch.Tensor:
    """:func:`run_pass` with the operator of ``key`` already looked up."""
    if a.is_cuda:
        out = _repeat_on_cuda(op, pass_name, a, b)
        if out is not None:
            return out
    shape = _updat_shape(a, b, key, op.feature_axis) if pass_name == "updat" else \
        _product_shape(a, b, key, op.feature_axis, pass_name)
    return into_new(getattr(op, pass_name), a, b, shape)


#: torch dtype -> the NumPy dtype of the CuPy arrays the checked path shares (repeat calls' keys).
_ARRAY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
                 torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _repeat_on_cuda(op: BlocksparseMatMul, pass_name: str, a: torch.Tensor, b: torch.Tensor):
    """The pass through the call ``op`` kept from an earlier checked call of this shape
    (``bsmm.backends.cuda.backend.FastCall``), or None where there is none or anything differs from it."""
    call = op._gpu_calls.get((pass_name, a.shape, _ARRAY_DTYPES.get(a.dtype), op.feature_axis, op.tf32))
    if call is None or b.dtype is not a.dtype or b.shape != call.other_shape or not (
            a.is_contiguous() and b.is_contiguous()):
        return None
    device = a.get_device()
    if b.get_device() != device or device != call.device or launches.current_device() != device:
        return None
    out = torch.empty(call.out_shape, dtype=a.dtype, device=device)  # (an int is a CUDA device index)
    a_ptr, b_ptr, out_ptr = a.data_ptr(), b.data_ptr(), out.data_ptr()
    if call.aligned and (a_ptr | b_ptr | out_ptr) & 15:
        return None
    stream = _raw_stream(device) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream
    call.launch(stream, a_ptr, b_ptr, out_ptr)
    return out


def into_new(method, a: torch.Tensor, b: torch.Tensor, shape: tuple, **options) -> torch.Tensor:
    """``method(a, b, out=..., **options)`` on shared NumPy/CuPy views, into a new tensor of ``shape``."""
    out = torch.empty(shape, dtype=a.dtype, device=a.device)
    if a.device.type == "cpu":
        method(_shared_as(np, a), _shared_as(np, b), out=_shared_as(np, out), **options)
    elif a.device.type == "cuda":
        import cupy

        ptr = torch.cuda.current_stream(a.device).cuda_stream
        # Import under torch's stream: DLPack then sees producer and consumer on one stream and adds no wait.
        with cupy.cuda.Device(a.device.index), _cupy_stream(cupy, a.device.index, ptr):
            method(_shared_as(cupy, a), _shared_as(cupy, b), out=_shared_as(cupy, out), **options)
    else:
        raise ValueError(f"tensors are on {a.device}; bsmm runs on the CPU and on CUDA GPUs")
    return out


# -- the operators -----------------------------------------------------------------------------------
@torch.library.custom_op("bsmm::matmul", mutates_args=())
def matmul(x: torch.Tensor, w: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """y = x·W: x (N, C) or (C, N) -> y (N, K) or (K, N); w (nnzb, bs, bs) of x's dtype and device."""
    return run_pass("fprop", x, w, key, feature_axis, tf32)


@torch.library.custom_op("bsmm::matmul_bprop", mutates_args=())
def matmul_bprop(dy: torch.Tensor, w: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """dx = dy·Wᵀ: dy (N, K) or (K, N) -> dx (N, C) or (C, N)."""
    return run_pass("bprop", dy, w, key, feature_axis, tf32)


@torch.library.custom_op("bsmm::matmul_updat", mutates_args=())
def matmul_updat(x: torch.Tensor, dy: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """dW = xᵀ·dy on the present blocks: x (N, C), dy (N, K) (or transposed) -> (nnzb, bs, bs)."""
    return run_pass("updat", x, dy, key, feature_axis, tf32)


@matmul.register_fake
def _matmul_fake(x, w, key, feature_axis, tf32):
    return x.new_empty(_product_shape(x, w, key, feature_axis, "fprop"))


@matmul_bprop.register_fake
def _bprop_fake(dy, w, key, feature_axis, tf32):
    return dy.new_empty(_product_shape(dy, w, key, feature_axis, "bprop"))


@matmul_updat.register_fake
def _updat_fake(x, dy, key, feature_axis, tf32):
    return x.new_empty(_updat_shape(x, dy, key, feature_axis))


def _setup_context(ctx, inputs, output) -> None:
    # The options are (key, feature_axis, tf32) for the products and (key, spec, tf32) for the convolutions.
    first, second, *options = inputs
    ctx.options = tuple(options)
    # Holding the registration keeps the key resolvable until backward, whatever the caller drops meanwhile.
    ctx.registration = _REGISTRY.get(options[0])
    needs_first, needs_second = ctx.needs_input_grad[:2]
    # In all three operators the gradient of one operand is a product with the other one only.
    ctx.save_for_backward(first if needs_second else None, second if needs_first else None)


def _autograd(first_gradient, second_gradient):
    """A backward from two formulas ``(g, first, second, *options) -> gradient``."""

    def backward(ctx, grad):
        first, second = ctx.saved_tensors
        # Upstream gradients are often expanded or transposed views (sum(), .T): the kernels need them dense.
        grad = grad.contiguous()
        needs_first, needs_second = ctx.needs_input_grad[:2]
        d_first = first_gradient(grad, first, second, *ctx.options) if needs_first else None
        d_second = second_gradient(grad, first, second, *ctx.options) if needs_second else None
        return d_first, d_second, None, None, None

    return backward


def register_bilinear(fprop, bprop, updat) -> None:
    """Autograd formulas of three operators with the cotangent structure of a product (module docstring)."""
    fprop.register_autograd(
        _autograd(lambda g, x, w, *o: bprop(g, w, *o), lambda g, x, w, *o: updat(x, g, *o)),
        setup_context=_setup_context,
    )
    bprop.register_autograd(
        _autograd(lambda g, dy, w, *o: fprop(g, w, *o), lambda g, dy, w, *o: updat(g, dy, *o)),
        setup_context=_setup_context,
    )
    updat.register_autograd(
        _autograd(lambda g, x, dy, *o: bprop(dy, g, *o), lambda g, x, dy, *o: fprop(x, g, *o)),
        setup_context=_setup_context,
    )


register_bilinear(matmul, matmul_bprop, matmul_updat)


class _EagerProduct(torch.autograd.Function):
    """``bsmm::matmul`` with its autograd formula, for eager calls: ``torch.autograd.Function``
    dispatches in a fraction of a custom operator's host time, and the passes run through
    :func:`run_pass` directly. A backward that builds a graph (``create_graph=True``) calls the
    differentiable operators, so gradients of any order stay available; ``torch.compile``
    traces the operators themselves (:func:`product`)."""

    @staticmethod
    def forward(ctx, x, w, key, feature_axis, tf32):
        ctx.options = (key, feature_axis, tf32)
        ctx.registration = _REGISTRY.get(key)  # the key stays resolvable until backward
        needs_x, needs_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if needs_w else None, w if needs_x else None)
        ctx.op = _matmul_operator(key, feature_axis, tf32)
        return _run_on(ctx.op, "fprop", x, w, key)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()  # (an expanded or transposed view, from sum() or .T)
        needs_x, needs_w = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: differentiable operators
            dx = matmul_bprop(grad, w, *ctx.options) if needs_x else None
            dw = matmul_updat(x, grad, *ctx.options) if needs_w else None
        else:
            key = ctx.options[0]
            dx = _run_on(ctx.op, "bprop", grad, w, key) if needs_x else None
            dw = _run_on(ctx.op, "updat", x, grad, key) if needs_w else None
        return dx, dw, None, None, None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors of no subclass (a layer's weight is a Parameter)
_EAGER_DEVICES = ("cpu", "cuda")  # (meta tensors take the operator's fake implementation)
# A TorchDispatchMode (make_fx tracing, FlopCounterMode, ...) sees the operators, not the kernels.
_dispatch_mode = torch.utils._python_dispatch._get_current_dispatch_mode
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", lambda: None)


def product(x: torch.Tensor, w: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """``bsmm::matmul`` (y = x·W, differentiable in both), through :class:`_EagerProduct` in eager
    mode on plain CPU and CUDA tensors, else the custom operator (``torch.compile``, ``make_fx``
    and other dispatch modes, ``torch.jit.trace``, fake, meta and functorch tensors, tensor
    subclasses)."""
    if (x.__class__ in _PLAIN and w.__class__ in _PLAIN and x.device.type in _EAGER_DEVICES
            and not torch.compiler.is_compiling() and _functorch_level() is None and _dispatch_mode() is None
            and not torch.jit.is_tracing()):
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _EagerProduct.apply(x, w, key, feature_axis, tf32)
        return run_pass("fprop", x, w, key, feature_axis, tf32)  # inference: no graph to record
    return matmul(x, w, key, feature_axis, tf32)
