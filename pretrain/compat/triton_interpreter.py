"""A Triton interpreter workaround (part of `pretrain.compat`; not megatron-core's).

Applied by `pretrain.compat.install()` when TRITON_INTERPRET=1 (Triton's CPU interpreter, which the
CPU tests of the DSA kernels use) and triton imports.
"""

from __future__ import annotations

from pretrain.compat.registry import Workaround


_TRITON_INTERPRETER_PATCHED = False


def patch_triton_interpreter() -> None:
    """Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) keeps scalars as 1-element numpy arrays
    and turns them into loop bounds with int(array), which NumPy >= 2.4 refuses for arrays with a
    dimension ("only 0-dimensional arrays can be converted"): a kernel with a data-dependent loop
    bound fails under the interpreter only. Convert through .item() instead. No-op on the GPU."""
    global _TRITON_INTERPRETER_PATCHED
    if _TRITON_INTERPRETER_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _TRITON_INTERPRETER_PATCHED = True


WORKAROUNDS = [
    Workaround(
        name="patch_triton_interpreter",
        target="triton.runtime.interpreter._patch_lang_tensor (Triton 3.6)",
        reason="with NumPy >= 2.4 a kernel with a data-dependent loop bound fails under TRITON_INTERPRET=1",
        upstream="open (Triton 3.6 interpreter)",
        test="tests/test_dsa_kernels.py::test_indexer_scores_and_exact_selection",
        install=patch_triton_interpreter,
        when="triton_interpreter",
    ),
]
