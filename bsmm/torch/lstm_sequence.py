""":class:`~bsmm.torch.BlockSparseLSTM` over a whole sequence: forward and backpropagation through time.

A sequence is one differentiable operation, not a graph of per-step operators:

- forward: ``x·Wx`` of all ``T`` steps is one pass over ``T·N`` rows; each step then adds
  ``h_{t-1}·Wh`` (a pass over ``N`` rows) and applies the cell's element-wise math.
- backward: the steps in reverse give each step's pre-activation gradient ``dz_t`` and
  ``dh_{t-1} = dz_t·Whᵀ`` (a pass over ``N`` rows). The weight gradients then come from one
  ``updat`` each over all ``T·N`` rows: ``dWh = Σ_t h_{t-1}ᵀ·dz_t`` from the stacked states,
  the sum over the steps taken inside the pass's float32 accumulator, into one buffer. Autograd
  over per-step operators would instead make ``T`` separate ``dWh`` tensors and add them up,
  rounding every partial sum to the weight's dtype. ``dx`` and ``dWx`` are one pass each as well.

On CUDA a step is two launches each way, the recurrent pass and the fused cell
(:mod:`bsmm.torch.lstm_steps`), replayed from the layer's CUDA graphs where it keeps them; on the
CPU the cell is PyTorch's element-wise operators. The cell state and the gate activations are
float32 (float64 for float64): in half precision only the products' operands and the returned
states are rounded, as in :class:`bsmm.nn.lstm.BlocksparseLSTM`.

Eagerly the sequence is :class:`Sequence` (an autograd function). Under ``torch.compile`` it is
:class:`CompiledSequence`, whose forward and backward are the operators ``bsmm::lstm_forward`` and
``bsmm::lstm_backward`` (fake kernels give their shapes): a compiled model has no graph break
at the layer. Their tensors are new each call (no graph buffers: an operator's outputs are its own).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from bsmm.matmul import BlocksparseMatMul
from bsmm.nn.lstm_gates import GATES
from bsmm.torch import lstm_steps
from bsmm.torch.passes import kept_store_call, matmul_operator, run_on

__all__ = ["SequencePlan", "Sequence", "CompiledSequence", "plan_of"]

_GATES = len(GATES)


class SequencePlan(NamedTuple):
    """The passes of one forward call: an operator and its registry key per block-sparse matrix.

    ``input_op`` and ``input_key`` are None where ``Wx`` is dense (plain ``torch.matmul``). The
    registrations keep both keys resolvable until the backward has run, whatever the caller drops.
    ``captures``: functions the eager backward calls with ``(h_in, x, dz)`` rows
    (:meth:`bsmm.torch.BlockSparseLSTM.register_gradient_capture`).
    """

    recurrent_op: BlocksparseMatMul
    recurrent_key: str
    input_op: BlocksparseMatMul | None
    input_key: str | None
    registrations: tuple
    graphs: lstm_steps.SequenceGraphs | None = None  # the layer's, where it replays its loops from CUDA graphs
    captures: tuple = ()


def plan_of(recurrent_key: str, input_key: str | None, tf32: bool, registrations: tuple = (),
            graphs: lstm_steps.SequenceGraphs | None = None, captures: tuple = ()) -> SequencePlan:
    """The plan of layouts registered under these keys (:mod:`bsmm.torch.registry`)."""
    return SequencePlan(matmul_operator(recurrent_key, 1, tf32), recurrent_key,
                        None if input_key is None else matmul_operator(input_key, 1, tf32), input_key,
                        registrations, graphs, captures)


def _input_fprop(rows: torch.Tensor, weight: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
    if plan.input_op is None:
        return rows @ weight
    return run_on(plan.input_op, "fprop", rows, weight, plan.input_key)


def _input_bprop(dz: torch.Tensor, weight: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
    if plan.input_op is None:
        return dz @ weight.T
    return run_on(plan.input_op, "bprop", dz, weight, plan.input_key)


def _input_updat(rows: torch.Tensor, dz: torch.Tensor, plan: SequencePlan) -> torch.Tensor:
    if plan.input_op is None:
        return rows.T @ dz
    return run_on(plan.input_op, "updat", rows, dz, plan.input_key)


# -- the computation: new tensors (CPU, CUDA launched) or a buffer set's (CUDA graphs) ----------------------------
def forward_values(x, h0, c0, weight_ih, weight_hh, bias, plan: SequencePlan):
    """(out, cells, gates) of new tensors: ``x`` (T, N, I) contiguous, ``h0``, ``c0`` (N, H)."""
    if x.is_cuda:
        with torch.cuda.device(x.device):
            return _launched_forward(x, h0, c0, weight_ih, weight_hh, bias, plan)
    return _cpu_forward(x, h0, c0, weight_ih, weight_hh, bias, plan)


def _cpu_forward(x, h0, c0, weight_ih, weight_hh, bias, plan):
    steps, n, _ = x.shape
    hidden = h0.shape[1]
    master = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = _input_fprop(x.view(steps * n, -1), weight_ih, plan)
    # Written in place step after step: the pass's fresh output, or its float32 copy.
    gates = z.to(master).view(steps, n, _GATES * hidden)
    if bias is not None:
        gates += bias
    out = x.new_empty(steps, n, hidden)
    cells = gates.new_empty(steps + 1, n, hidden)
    cells[0] = c0
    h_prev = h0
    for t in range(steps):
        step = gates[t]
        step += run_on(plan.recurrent_op, "fprop", h_prev, weight_hh, plan.recurrent_key)
        step[:, :3 * hidden].sigmoid_()
        step[:, 3 * hidden:].tanh_()
        i, f, o, g = step.split(hidden, dim=1)
        torch.addcmul(f * cells[t], i, g, out=cells[t + 1])
        out[t] = o * torch.tanh(cells[t + 1])
        h_prev = out[t]
    return out, cells, gates


def _launched_forward(x, h0, c0, weight_ih, weight_hh, bias, plan):
    """CUDA: the loop of :func:`~bsmm.torch.lstm_steps.forward_steps` launched step after step."""
    steps, n, _ = x.shape
    hidden = h0.shape[1]
    z = _input_fprop(x.view(steps * n, -1), weight_ih, plan).view(steps, n, _GATES * hidden)
    bias_f32 = None if bias is None else bias.to(torch.float32).contiguous()
    out = x.new_empty(steps, n, hidden)
    cells = torch.empty(steps + 1, n, hidden, dtype=torch.float32, device=x.device)
    cells[0] = c0
    gates = torch.empty(steps, n, _GATES * hidden, dtype=torch.float32, device=x.device)
    z_rec = run_on(plan.recurrent_op, "fprop", h0, weight_hh, plan.recurrent_key)
    call = _kept(plan.recurrent_op, "fprop", h0, weight_hh)
    lstm_steps.forward_steps(lstm_steps.StepLaunches(x.device, x.dtype), call, weight_hh, z, h0,
                             0 if bias_f32 is None else bias_f32.data_ptr(), cells, gates, out, z_rec, first_done=True)
    return out, cells, gates


def _graph_forward(x, h0, c0, weight_ih, weight_hh, bias, plan, call):
    """CUDA: the loop replayed from the graph of a buffer set of the layer's
    (:class:`~bsmm.torch.lstm_steps.SequenceGraphs`), inputs copied in; (out, cells, gates, buffers,
    token), the first three the set's (copy what leaves; keep the token while they are in use)."""
    steps, n, _ = x.shape
    hidden = h0.shape[1]
    key = lstm_steps.SetKey(steps, n, x.dtype, x.device, weight_hh.data_ptr(), bias is not None,
                            id(plan.recurrent_op))
    buffers, token = plan.graphs.acquire(key, lambda: lstm_steps.StepBuffers(steps, n, hidden, x.dtype, x.device,
                                                                             bias is not None))
    rows = x.view(steps * n, -1)
    z_rows = buffers.z.view(steps * n, -1)
    in_call = None if plan.input_op is None else kept_store_call(plan.input_op, "fprop", rows, weight_ih)
    if plan.input_op is None:
        torch.matmul(rows, weight_ih, out=z_rows)
    elif in_call is not None:
        in_call.launch(torch.cuda.current_stream(x.device).cuda_stream, rows.data_ptr(), weight_ih.data_ptr(),
                       z_rows.data_ptr())
    else:
        z_rows.copy_(_input_fprop(rows, weight_ih, plan))
    buffers.h0.copy_(h0)
    buffers.cells[0].copy_(c0)
    if bias is not None:
        buffers.bias.copy_(bias)
    if buffers.forward_graph is None:
        bias_ptr = 0 if bias is None else buffers.bias.data_ptr()
        buffers.calls.append(call)
        buffers.forward_graph = lstm_steps.capture(x.device, lambda: lstm_steps.forward_steps(
            lstm_steps.StepLaunches(x.device, x.dtype), call, weight_hh, buffers.z, buffers.h0, bias_ptr,
            buffers.cells, buffers.gates, buffers.out, buffers.z_rec))
    buffers.forward_graph.replay()
    return buffers.out, buffers.cells, buffers.gates, buffers, token


def backward_values(saved, d_out, d_h_last, d_c_last, plan: SequencePlan, needs, buffers=None) -> tuple:
    """(dx, dh0, dc0, dWx, dWh, db), None where ``needs`` (of x, h0, c0, Wx, Wh, b) is false, from the
    forward's ``saved`` (x, h0, Wx, Wh, out, cells, gates); ``buffers``: the forward's set, where its
    loop was replayed from a graph and the set is still the forward's (its token saved with it)."""
    if saved[0].is_cuda:
        with torch.cuda.device(saved[0].device):
            return _cuda_backward(saved, d_out, d_h_last, d_c_last, plan, needs, buffers)
    return _cpu_backward(saved, d_out, d_h_last, d_c_last, plan, needs)


def _cpu_backward(saved, d_out, d_h_last, d_c_last, plan, needs):
    x, h0, weight_ih, weight_hh, out, cells, gates = saved
    steps, n, hidden = out.shape
    dtype, master = out.dtype, cells.dtype
    d_out = d_out.to(master)
    dh_next, dc_next = d_h_last.to(master, copy=True), d_c_last.to(master, copy=True)
    dz = torch.empty_like(gates)
    for t in reversed(range(steps)):
        dh = dh_next + d_out[t]
        i, f, o, g = gates[t].split(hidden, dim=1)
        tanh_c = torch.tanh(cells[t + 1])
        dc = torch.addcmul(dc_next, dh * o, 1 - tanh_c * tanh_c)
        d_i, d_f, d_o, d_g = dz[t].split(hidden, dim=1)
        torch.mul(dc * g, i * (1 - i), out=d_i)
        torch.mul(dc * cells[t], f * (1 - f), out=d_f)
        torch.mul(dh * tanh_c, o * (1 - o), out=d_o)
        torch.mul(dc * i, 1 - g * g, out=d_g)
        dc_next = dc * f
        dh_next = run_on(plan.recurrent_op, "bprop", dz[t].to(dtype), weight_hh, plan.recurrent_key).to(master)
    grads = _weight_grads(x, h0, weight_ih, out, dz.view(steps * n, _GATES * hidden).to(dtype), plan, needs)
    d_bias = dz.sum(dim=(0, 1)).to(dtype) if needs[5] else None
    return (grads[0], dh_next.to(dtype) if needs[1] else None, dc_next.to(dtype) if needs[2] else None,
            grads[1], grads[2], d_bias)


def _cuda_backward(saved, d_out, d_h_last, d_c_last, plan, needs, buffers):
    x, h0, weight_ih, weight_hh, out, cells, gates = saved
    steps, n, hidden = out.shape
    call = None if buffers is None or lstm_steps.capturing() else \
        kept_store_call(plan.recurrent_op, "bprop", buffers.dz[0], weight_hh)
    if call is not None:
        dz, dh0, dc = _graph_backward(buffers, call, weight_hh, d_out, d_h_last, d_c_last, needs[1])
    else:
        dz = torch.empty(steps, n, _GATES * hidden, dtype=out.dtype, device=out.device)
        dc = d_c_last.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # updated in place

        def first_bprop(t):
            return (run_on(plan.recurrent_op, "bprop", dz[t], weight_hh, plan.recurrent_key),
                    _kept(plan.recurrent_op, "bprop", dz[t], weight_hh))

        dh0 = lstm_steps.backward_steps(lstm_steps.StepLaunches(out.device, out.dtype), None, weight_hh,
                                        d_out.to(torch.float32).contiguous(), d_h_last.to(torch.float32).contiguous(),
                                        dc, gates, cells, dz, None, needs[1], first_bprop)
    dz_rows = dz.view(steps * n, _GATES * hidden)
    grads = _weight_grads(x, h0, weight_ih, out, dz_rows, plan, needs)
    # Summed in float32 from dz in the passes' dtype (the float32 dz of the CPU path is not kept).
    d_bias = dz_rows.sum(dim=0, dtype=torch.float32).to(out.dtype) if needs[5] else None
    return (grads[0], dh0 if needs[1] else None, dc.to(out.dtype, copy=True) if needs[2] else None,
            grads[1], grads[2], d_bias)


def _weight_grads(x, h0, weight_ih, out, dz_rows, plan, needs) -> tuple:
    """(dx, dWx, dWh) from every step's dz stacked, (T·N, 4H) in the passes' dtype."""
    steps, n, hidden = out.shape
    d_weight_hh = None
    rows = x.view(steps * n, -1)
    if needs[4] or plan.captures:
        # The states each step read, h_0 ... h_{T-1}, stacked: one updat sums over the steps.
        h_in = torch.cat((h0.unsqueeze(0), out[:-1])).view(steps * n, hidden)
        for capture in plan.captures:
            capture(h_in, rows, dz_rows)
        if needs[4]:
            d_weight_hh = run_on(plan.recurrent_op, "updat", h_in, dz_rows, plan.recurrent_key)
    d_x = _input_bprop(dz_rows, weight_ih, plan).view(x.shape) if needs[0] else None
    d_weight_ih = _input_updat(rows, dz_rows, plan) if needs[3] else None
    return d_x, d_weight_ih, d_weight_hh


def _graph_backward(buffers, call, weight_hh, d_out, d_h_last, d_c_last, need_dh0: bool):
    """The backward loop replayed from the graph of the forward's buffer set: (dz, dh0, dc), dz and dc
    the set's (read before the set is freed), dh0 a copy."""
    buffers.d_out.copy_(d_out)
    buffers.dh_init.copy_(d_h_last)
    buffers.dc.copy_(d_c_last)
    graph = buffers.backward_graphs.get(need_dh0)
    if graph is None:
        buffers.calls.append(call)
        graph = buffers.backward_graphs[need_dh0] = lstm_steps.capture(buffers.dz.device, lambda: lstm_steps.backward_steps(
            lstm_steps.StepLaunches(buffers.dz.device, buffers.dz.dtype), call, weight_hh, buffers.d_out,
            buffers.dh_init, buffers.dc, buffers.gates, buffers.cells, buffers.dz, buffers.dh_rec, need_dh0))
    graph.replay()
    return buffers.dz, buffers.dh_rec.clone() if need_dh0 else None, buffers.dc


def _kept(op, pass_name: str, a: torch.Tensor, b: torch.Tensor):
    """The call ``op`` kept for the pass just run on ``a`` and ``b``."""
    call = kept_store_call(op, pass_name, a, b)
    if call is None:
        raise RuntimeError(f"bsmm: BlockSparseLSTM found no kept {pass_name} call after running it on {tuple(a.shape)}; "
                           "please report this")
    return call


# -- eager: an autograd function over the computation above ------------------------------------------------------
class Sequence(torch.autograd.Function):
    """The layer over a whole sequence, eagerly: ``(x, h0, c0, Wx, Wh, b, plan)`` -> ``(h_1..h_T, h_T, c_T)``;
    ``x`` (T, N, I) contiguous, ``h0`` and ``c0`` (N, H)."""

    @staticmethod
    def forward(ctx, x, h0, c0, weight_ih, weight_hh, bias, plan):
        buffers = call = None
        if x.is_cuda and plan.graphs is not None and not lstm_steps.capturing():
            with torch.cuda.device(x.device):
                call = kept_store_call(plan.recurrent_op, "fprop", h0, weight_hh)
                if call is not None:
                    out, cells, gates, buffers, token = _graph_forward(x, h0, c0, weight_ih, weight_hh, bias, plan,
                                                                       call)
        if call is None:
            out, cells, gates = forward_values(x, h0, c0, weight_ih, weight_hh, bias, plan)
            token = torch.empty(0)  # (no set to hold: saved so that the saved tensors keep one layout)
        # The token is saved with the tensors: the set is the forward's until autograd frees them.
        ctx.plan, ctx.buffers = plan, buffers
        ctx.save_for_backward(x, h0, weight_ih, weight_hh, out, cells, gates, token)
        # Copies: what leaves is the caller's (a set's buffers are written again by a later call, and an
        # output that is a view of a saved tensor could not be changed in place).
        return out.clone() if buffers is not None else out, out[-1].clone(), cells[-1].to(x.dtype, copy=True)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_h_last, d_c_last):
        *saved, token = ctx.saved_tensors
        buffers = ctx.buffers if ctx.buffers is not None and ctx.buffers.owned_by(token) else None
        return (*backward_values(saved, d_out, d_h_last, d_c_last, ctx.plan, ctx.needs_input_grad, buffers), None)


# -- compiled: the same computation as two operators -------------------------------------------------------------
@torch.library.custom_op("bsmm::lstm_forward", mutates_args=())
def lstm_forward(x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, weight_ih: torch.Tensor,
                 weight_hh: torch.Tensor, bias: Optional[torch.Tensor], recurrent_key: str,
                 input_key: Optional[str], tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (T, N, H), cells (T + 1, N, H), gates (T, N, 4H)) of the sequence; cells and gates float32
    (float64 for float64), what :func:`lstm_backward` reads."""
    return forward_values(x, h0, c0, weight_ih, weight_hh, bias, plan_of(recurrent_key, input_key, tf32))


@lstm_forward.register_fake
def _lstm_forward_fake(x, h0, c0, weight_ih, weight_hh, bias, recurrent_key, input_key, tf32):
    steps, n, _ = x.shape
    hidden = h0.shape[1]
    master = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.new_empty(steps, n, hidden), x.new_empty((steps + 1, n, hidden), dtype=master),
            x.new_empty((steps, n, _GATES * hidden), dtype=master))


@torch.library.custom_op("bsmm::lstm_backward", mutates_args=())
def lstm_backward(x: torch.Tensor, h0: torch.Tensor, weight_ih: torch.Tensor, weight_hh: torch.Tensor,
                  out: torch.Tensor, cells: torch.Tensor, gates: torch.Tensor, d_out: torch.Tensor,
                  d_h_last: torch.Tensor, d_c_last: torch.Tensor, recurrent_key: str, input_key: Optional[str],
                  tf32: bool, needs: list[bool]) -> list[torch.Tensor]:
    """(dx, dh0, dc0, dWx, dWh, db), an empty tensor for each gradient ``needs`` does not ask for."""
    grads = backward_values((x, h0, weight_ih, weight_hh, out, cells, gates), d_out, d_h_last, d_c_last,
                            plan_of(recurrent_key, input_key, tf32), needs)
    return [x.new_empty(0) if grad is None else grad for grad in grads]


@lstm_backward.register_fake
def _lstm_backward_fake(x, h0, weight_ih, weight_hh, out, cells, gates, d_out, d_h_last, d_c_last, recurrent_key,
                        input_key, tf32, needs):
    like = (x, h0, h0, weight_ih, weight_hh, out.new_empty(gates.shape[-1]))
    return [t.new_empty(t.shape) if need else x.new_empty(0) for t, need in zip(like, needs)]


class CompiledSequence(torch.autograd.Function):
    """:class:`Sequence` as ``torch.compile`` traces it: ``bsmm::lstm_forward`` and ``bsmm::lstm_backward``
    over registry keys (``(x, h0, c0, Wx, Wh, b, recurrent_key, input_key, tf32)``)."""

    @staticmethod
    def forward(ctx, x, h0, c0, weight_ih, weight_hh, bias, recurrent_key, input_key, tf32):
        out, cells, gates = lstm_forward(x, h0, c0, weight_ih, weight_hh, bias, recurrent_key, input_key, tf32)
        ctx.keys = (recurrent_key, input_key, tf32)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, h0, weight_ih, weight_hh, out, cells, gates)
        return out, out[-1].clone(), cells[-1].to(x.dtype, copy=True)

    @staticmethod
    def backward(ctx, d_out, d_h_last, d_c_last):
        needs = list(ctx.needs_input_grad[:6])
        needs[5] = needs[5] and ctx.has_bias
        grads = lstm_backward(*ctx.saved_tensors, d_out.contiguous(), d_h_last.contiguous(), d_c_last.contiguous(),
                              *ctx.keys, needs)
        return (*(grad if need else None for grad, need in zip(grads, needs)), None, None, None)
