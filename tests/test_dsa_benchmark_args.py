"""The DSA GPU benchmarks refuse bad arguments in one line before any GPU work (they run here, without a GPU, as far
as their argument checks)."""

import sys

import pytest


@pytest.mark.parametrize("module, argv, message", [
    ("dsa_heads_sweep", ["--key-partition-mib", "x"], "--key-partition-mib takes numbers"),
    ("dsa_heads_sweep", ["--key-partition-mib", "-1"], "--key-partition-mib values must be >= 0"),
    ("dsa_heads_sweep", ["--dkv-modes", "bogus"], "unknown --dkv-modes"),
    ("dsa_heads_sweep", ["--atomics", "vector,bogus"], "unknown --atomics"),
    ("dsa_heads_sweep", ["--ws", "off,maybe"], "unknown --ws"),
    ("dsa_kernels", ["--key-partition-mib", "-2"], "--key-partition-mib must be >= 0"),
    ("dsa_topk_sweep", ["--select", "5"], "--select entries are"),
    ("dsa_topk_sweep", ["--score-configs", "4x64x8"], "--score-configs entries are"),
    ("dsa_dkv_probe", ["--configs", "64x128x3x4"], "--configs entries are"),
    ("dsa_dkv_probe", ["--writes", "atomic,bogus"], "--writes takes"),
    ("dsa_first_pass_probe", ["--dq-configs", "64x2x1"], "--dq-configs entries are"),
])
def test_bad_arguments_are_refused_before_gpu_work(monkeypatch, capsys, module, argv, message):
    import importlib

    mod = importlib.import_module(f"benchmarks.{module}")
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    with pytest.raises(SystemExit) as err:
        mod.main()
    assert err.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0]


def test_dkv_probe_kernel_builds_for_hopper():
    """The probe's Gluon kernel lowers, for sm_90 without a GPU (Triton's bundled ptxas), to warp-group MMAs and
    16-byte fp32 reductions (whole rows per warp), and to plain stores in its store mode: what its measurements
    rest on (benchmarks/results/README.md, "What bounds the key-gradient pass")."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.dsa_dkv_probe import dkv_kernel as fn

    def ptx(write, rope):
        cons = dict(C=512, R=64, H=64, BN=64, DS=64 if rope else 128, NSL=1 if rope else 4, ROPE=rope, NBUF=3,
                    ATOMIC_VEC=4, WRITE=write, num_warps=4)
        types = {"idx_ptr": "*i32", "nv_ptr": "*i32", "dkv_ptr": "*fp32"}
        sig = {n: "constexpr" if n in cons else (types.get(n, "*bf16") if n.endswith("_ptr") else "i32")
               for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in cons}
        src = GluonASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs)
        options = dict(num_warps=4, **({"maxnreg": 128} if write == 3 else {}))
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    for rope in (False, True):
        atomic = ptx(0, rope)
        assert atomic.count("wgmma.mma_async") >= (4 if rope else 8)
        assert re.search(r"(red|atom)\.global\.[a-z.]*add\.v4\.f32", atomic)
    writer = ptx(3, False)  # the atomics in a second partition: still wgmma and 16-byte reductions
    assert writer.count("wgmma.mma_async") >= 8 and re.search(r"(red|atom)\.global\.[a-z.]*add\.v4\.f32", writer)
    store = ptx(1, False)
    assert not re.search(r"(red|atom)\.global\.[a-z.]*add", store) and "st.global.v4" in store
