"""The three passes of a block-sparse product, as one table of what each reads and writes.

For a layer y = x·W with x of C features and y of K: fprop computes y from x and W, bprop
dx from dy and Wᵀ, updat dW from x and dy on the present blocks. Code that treats the passes
differently asks this table (``PASSES[name].updates_weights``) instead of comparing names.

Examples
--------
>>> fprop, bprop, updat = PASSES.values()
>>> fprop.operands, fprop.output, fprop.features_in, fprop.features_out
(('x', 'w'), 'y', 'C', 'K')
>>> bprop.reads_weights_transposed, updat.updates_weights
(True, True)
"""

from __future__ import annotations

import dataclasses

__all__ = ["BlockPass", "PASSES", "PASS_NAMES"]


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


PASSES: dict[str, BlockPass] = {
    "fprop": BlockPass("fprop", ("x", "w"), "y", "C", "K", updates_weights=False, reads_weights_transposed=False),
    "bprop": BlockPass("bprop", ("dy", "w"), "dx", "K", "C", updates_weights=False, reads_weights_transposed=True),
    "updat": BlockPass("updat", ("x", "dy"), "dw", "C", "K", updates_weights=True, reads_weights_transposed=False),
}
PASS_NAMES = tuple(PASSES)
