"""The plans kept per layout: :func:`plan_for` builds a pass's plan on first use (a
:class:`~bsmm.backends.cuda.plans.Plan`, or one of :mod:`bsmm.backends.cuda.copy_plans` around
one) and keeps it per (pass, N, dtype, feature axis, math mode, alignment, device, policy,
epilogue) while the layout lives; :func:`plans_of` lists them, :func:`forget_plans` drops them.
Above both plan modules, so that neither imports the other's users.
"""

from __future__ import annotations

import logging
import threading
import weakref

import cupy

from bsmm.block_index import BlockIndex
from bsmm.config import once, settings, tuned_path, warn
# Through the module: tests count plan builds by replacing plans.build_plan.
from bsmm.backends.cuda import copy_plans, plans
from bsmm.backends.cuda.plans import Plan
from bsmm.backends.cuda.policy import Policy, current_policy
from bsmm.backends.cuda.selection import copies, transposes_weights
from bsmm.backends.strided import BlockOrder

__all__ = ["forget_plans", "plan_for", "plans_of"]

_log = logging.getLogger(__name__)


_PLANS: "weakref.WeakKeyDictionary[BlockIndex, dict]" = weakref.WeakKeyDictionary()

_PLAN_LOCK = threading.Lock()


def forget_plans() -> None:
    """Drop every cached plan, so that the next call of a pass plans it again (plans are kept per
    :class:`~bsmm.backends.cuda.policy.Policy`, so a new policy never needs this). Operators keep the calls they already made
    (:class:`FastCall`): make new ones."""
    with _PLAN_LOCK:
        _PLANS.clear()


def plan_for(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool,
             aligned: bool, act_blocks: tuple | None = None, weight_blocks: BlockOrder | None = None,
             plain: bool = False, epilogue: str = "store") -> Plan:
    """The cached plan for this pass on the current device, built on first use.

    ``plain``: the operands are whole (N, C) and (N, K) arrays (or their feature-axis-0
    transposes), so the pass may read transposed copies of them (:mod:`bsmm.backends.cuda.copy_plans`);
    strided and shifted passes are not. A TF32 fprop gets its ``TransposedWeightsFprop`` where
    that applies (:func:`bsmm.backends.cuda.selection.copies`). Plans are kept per
    :func:`~bsmm.backends.cuda.policy.current_policy`. ``epilogue``: a name of
    :data:`bsmm.epilogues.EPILOGUES`, the kernel's way out (fprop and bprop).
    """
    device_id = cupy.cuda.runtime.getDevice()
    policy = current_policy()
    key = (pass_name, n, dtype, feature_axis, tf32, aligned, device_id, act_blocks, weight_blocks, plain, policy,
           epilogue)
    kept = _PLANS.get(index)
    plan = kept.get(key) if kept is not None else None
    if plan is None:
        with _PLAN_LOCK:
            kept = _PLANS.setdefault(index, {})
            plan = kept.get(key)
            if plan is None:
                plan = kept[key] = _new_plan(index, pass_name, n, dtype, feature_axis, tf32, aligned, act_blocks,
                                              weight_blocks, plain, cupy.cuda.Device(device_id), policy, epilogue)
    return plan


def _new_plan(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
              act_blocks, weight_blocks, plain: bool, device, policy: Policy, epilogue: str = "store"):
    """The plan :func:`plan_for` keeps: a :class:`Plan`, or one of the copying plans around one."""
    traits = plans.device_traits(device)
    _tell_once(traits.arch, aligned, device.id)
    if plain:
        copied = copies(index, pass_name, n, dtype, feature_axis, tf32, aligned, traits, policy)
    elif act_blocks is None and weight_blocks is None and pass_name == "fprop" and transposes_weights(
            index, n, dtype, feature_axis, tf32, aligned, traits, policy):
        copied = "w"
    else:
        copied = ""
    if copied == "w":
        return copy_plans.TransposedWeightsFprop(index, n, device, policy, epilogue)
    if copied == "x+dy":
        return copy_plans.TransposedUpdat(index, n, dtype, device, policy, tf32)
    if copied:
        return copy_plans.TransposedActivations(index, pass_name, n, dtype, device, policy, epilogue)
    return plans.build_plan(index, pass_name, n, dtype, feature_axis, tf32, aligned, device, policy, act_blocks,
                      weight_blocks, epilogue=epilogue)


def _tell_once(arch: str, aligned: bool, device_id: int) -> None:
    """What a plan about to be built cannot use, logged once a process: the Hopper kernels on
    another architecture, 16-byte vector copies for unaligned operands; and a warning where the
    tuned launch tiles of ``arch`` were measured on a GPU other than device ``device_id``."""
    if arch != "sm90" and once(("arch", arch)):
        _log.info("%s: the wgmma and TMA kernels are built for Hopper (sm_90a) only%s; the cp.async kernels run "
                  "instead", arch, ", programmatic launches need sm_90" if int(arch[2:]) < 90 else "")
    if not aligned and once("unaligned"):
        _log.info("a pass reads operands that are not 16-byte aligned (an array's start or row stride, or on "
                  "feature axis 0 a batch whose rows are not whole 16-byte chunks): it runs a kernel without "
                  "16-byte vector copies, which is slower")
    measured = {record.get("device") for entry, record in settings().get("tuned", {}).items()
                if entry.split(".")[0] == arch}
    if measured and once(("tuned device", arch)):
        name = _device_name(device_id)
        if measured - {name}:
            warn(f"the tuned launch tiles for {arch} in {tuned_path()} were measured on "
                 f"{', '.join(sorted(map(str, measured - {name})))}, not on this {name}: run `python -m bsmm tune` "
                 "on this GPU, or set BSMM_TUNED=0 to use bsmm.toml's tiles")


def _device_name(device_id: int) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def plans_of(index: BlockIndex) -> dict:
    """A copy of the plans cached for ``index``: {(pass, N, dtype, feature axis, tf32, aligned,
    device, activation blocks, weight blocks, plain, policy, epilogue): plan}; empty where none was built."""
    with _PLAN_LOCK:
        return dict(_PLANS.get(index, {}))
