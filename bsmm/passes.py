"""The three passes of a block-sparse product, as one table of what each reads and writes.

For a layer y = x·W with x of C features and y of K: fprop computes y from x and W, bprop
dx from dy and Wᵀ, updat dW from x and dy on the present blocks. Code that treats the passes
differently asks this table (``PASSES[name].updates_weights``) instead of comparing names. It
is the one source of each pass's operands, output shape (:meth:`BlockPass.output_shape`) and
cotangents (:attr:`BlockPass.cotangents`): the framework adapters' operators, fake kernels and
autograd rules read it.

Examples
--------
>>> fprop, bprop, updat = PASSES.values()
>>> fprop.operands, fprop.output, fprop.features_in, fprop.features_out
(('x', 'w'), 'y', 'C', 'K')
>>> bprop.reads_weights_transposed, updat.updates_weights
(True, True)
>>> fprop.output_shape(C=16, K=24, w_shape=(3, 8, 8), n=5, feature_axis=1)
(5, 24)
>>> fprop.cotangents  # dx = bprop(g, w), dw = updat(x, g)
(('bprop', 'g', 1), ('updat', 0, 'g'))
>>> cotangent_operands(updat.cotangents[0], ("x", "dy"), "g")
('dy', 'g')
"""

from __future__ import annotations

import dataclasses

__all__ = ["BlockPass", "PASSES", "PASS_NAMES", "cotangent_operands"]


@dataclasses.dataclass(frozen=True)
class BlockPass:
    """One pass: its operands (the dense activations first), its output, and the layer sizes
    (``"C"`` or ``"K"``) of the activations' and the output's features (updat: of x and dy)."""

    name: str
    operands: tuple[str, str]
    output: str
    features_in: str
    features_out: str
    updates_weights: bool  # the output is the weight blocks (updat), not activations
    reads_weights_transposed: bool  # the weight blocks are read as Wᵀ (bprop)
    # The gradient of each operand given the output's gradient g: (pass, its first operand, its
    # second), each operand "g" or the index of one of this pass's own operands. Every pass is
    # bilinear, so each gradient is another pass of the same layout.
    cotangents: tuple = ()

    @property
    def walks_block_columns(self) -> bool:
        """Whether an output tile sums over a block column of the layout (fprop: y's features are
        its block columns); bprop sums over block rows, updat over the batch."""
        return not self.updates_weights and not self.reads_weights_transposed

    def features(self, C: int, K: int) -> tuple[int, int]:
        """(features of the activations, features of the output or of the second operand) of a
        layer of ``C`` inputs and ``K`` outputs."""
        sizes = {"C": C, "K": K}
        return sizes[self.features_in], sizes[self.features_out]

    def output_shape(self, C: int, K: int, w_shape: tuple, n: int, feature_axis: int) -> tuple:
        """The output's shape for ``n`` batch rows: the weight blocks' (updat), else (n, features)
        on feature axis 1 and (features, n) on axis 0."""
        if self.updates_weights:
            return tuple(w_shape)
        features = self.features(C, K)[1]
        return (n, features) if feature_axis == 1 else (features, n)


def cotangent_operands(rule: tuple, operands: tuple, gradient) -> tuple:
    """The two operands of one :attr:`BlockPass.cotangents` rule, from the pass's ``operands`` and
    the output's ``gradient``."""
    return tuple(gradient if which == "g" else operands[which] for which in rule[1:])


PASSES: dict[str, BlockPass] = {
    "fprop": BlockPass("fprop", ("x", "w"), "y", "C", "K", updates_weights=False, reads_weights_transposed=False,
                       cotangents=(("bprop", "g", 1), ("updat", 0, "g"))),
    "bprop": BlockPass("bprop", ("dy", "w"), "dx", "K", "C", updates_weights=False, reads_weights_transposed=True,
                       cotangents=(("fprop", "g", 1), ("updat", "g", 0))),
    "updat": BlockPass("updat", ("x", "dy"), "dw", "C", "K", updates_weights=True, reads_weights_transposed=False,
                       cotangents=(("bprop", 1, "g"), ("fprop", 0, "g"))),
}
PASS_NAMES = tuple(PASSES)
