"""Public namespaces: a mistyped class name is answered with the name meant; the adapters' dir()
lists what they export, not names of their own machinery."""

from __future__ import annotations

import pytest

import bsmm


@pytest.mark.parametrize("typed,meant", [("BlockSparseMatMul", "BlocksparseMatMul"),
                                         ("BlockSparseLSTM", "BlocksparseLSTM"),
                                         ("BlocksparseMatrix", "BlockSparseMatrix")])
def test_another_spelling_of_a_class_names_the_class(typed, meant):
    assert hasattr(bsmm, meant)
    with pytest.raises(AttributeError, match=rf"no attribute '{typed}'; the class is bsmm\.{meant}$"):
        getattr(bsmm, typed)


def test_a_missing_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"^module 'bsmm' has no attribute 'nothing_here'$"):
        bsmm.nothing_here  # noqa: B018


@pytest.mark.parametrize("adapter", ["bsmm", "bsmm.torch", "bsmm.jax", "bsmm.tf"])
def test_dir_of_a_namespace_holds_no_annotations_name(adapter):
    module = pytest.importorskip(adapter)
    assert "annotations" not in dir(module)
    assert set(module.__all__) <= set(dir(module))
