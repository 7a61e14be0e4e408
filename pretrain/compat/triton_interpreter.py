"""A Triton interpreter workaround (part of `pretrain.compat`; not megatron-core's).

Applied by `pretrain.compat.install()` when TRITON_INTERPRET=1 (Triton's CPU interpreter, which the
CPU tests of the DSA kernels use) and triton imports.
"""

from __future__ import annotations

from pretrain.compat.registry import Workaround


_TRITON_INTERPRETER_PATCHED = False


def patch_triton_interpreter() -> None:
    """Both fixes of Triton 3.6's CPU interpreter (TRITON_INTERPRET=1), once; no-op on the GPU:

    - scalars are 1-element numpy arrays turned into loop bounds with int(array), which NumPy >= 2.4 refuses
      for arrays with a dimension ("only 0-dimensional arrays can be converted"): a kernel with a
      data-dependent loop bound fails under the interpreter only. Convert through .item() instead.
    - `tl.atomic_add` hands its operands' numpy buffers to C++ as if contiguous: an operand that is a strided
      view (e.g. a `tl.split` half) adds the wrong elements (`patch_triton_interpreter_atomics`)."""
    global _TRITON_INTERPRETER_PATCHED
    if _TRITON_INTERPRETER_PATCHED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    patch_triton_interpreter_atomics()
    _TRITON_INTERPRETER_PATCHED = True


def patch_triton_interpreter_atomics() -> None:
    """Triton 3.6's interpreter passes `ptr.data`, `val.data` and `mask.data` of an atomic read-modify-write
    to its C++ `atomic_rmw`, which reads them as contiguous buffers: `tl.split` returns strided numpy views,
    so `tl.atomic_add(p, half)` added other elements than `half` holds (`kernels.atomics.add_rows`, mode 1).
    Hand it contiguous copies."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_atomic_rmw, "_contiguous", False):
        return
    original = builder.create_atomic_rmw

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        for t in (ptr, val, mask):
            t.data = np.ascontiguousarray(t.data)
        return original(self, rmwOp, ptr, val, mask, sem, scope)

    create_atomic_rmw._contiguous = True
    builder.create_atomic_rmw = create_atomic_rmw


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
    Workaround(
        name="patch_triton_interpreter_atomics",
        target="triton.runtime.interpreter.InterpreterBuilder.create_atomic_rmw (Triton 3.6)",
        reason="under TRITON_INTERPRET=1 tl.atomic_add of a strided tensor (a tl.split half) adds the wrong elements",
        upstream="open (Triton 3.6 interpreter)",
        test="tests/test_dsa_kernels.py::test_add_rows_matches_naive",
        install=patch_triton_interpreter_atomics,
        when="triton_interpreter",
    ),
]
