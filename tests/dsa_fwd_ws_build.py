"""Compile the warp-specialized sparse MLA kernels of `pretrain.model.dsa.kernels.hopper` (the forwards,
`forward_heads_m` and, for 8-32 heads, `forward_keys_m`; the backward's first pass, `first_pass`, and its query
gradient, `query_gradient`) with the default tuning's tiles for sm_90 without a GPU (Triton's bundled ptxas)
and print, per kernel and (C, R), what its PTX holds: warp-group MMAs, cp.async gathers and their mbarrier arrivals,
the loader partition's register budget, the threads of its barriers (one partition's warps), and the shared memory.

    TRITON_INTERPRET=0 python -m tests.dsa_fwd_ws_build     (tests/test_dsa_fwd_ws_build.py runs it)

Gluon's reductions cannot be compiled under TRITON_INTERPRET=1, which the CPU tests set: hence a process of its own.
"""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from pretrain.model.dsa.kernels.hopper import first_pass, forward_heads_m, forward_keys_m, loader, query_gradient
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING as TUNING


def build(c: int, r: int, kernel: str = "forward") -> dict:
    if kernel == "scores":  # two score warp groups of 4 warps and the loader; one stage each
        fn, cons = first_pass.scores_kernel, dict(H=64, C=c, R=r, BN=TUNING.first_pass_tiles[0], HEAD_SUMS=True,
                                                  num_warps=4)
    elif kernel.startswith("keys-as-M"):  # 8-32 heads: one consumer warp group and the loader
        (bn, nbuf), h = TUNING.keys_m_tiles, int(kernel.split()[-1])
        fn, cons = forward_keys_m.fwd_kernel, dict(H=h, C=c, R=r, BN=bn, NBUF=nbuf,
                                                   num_warps=forward_keys_m.CONSUMER_WARPS)
    else:
        fn, (bn, nbuf) = ((query_gradient.dq_kernel, TUNING.dq_tiles) if kernel == "dq"
                          else (forward_heads_m.fwd_kernel, TUNING.gluon_forward_tiles))
        cons = dict(H=64, C=c, R=r, BN=bn, NBUF=nbuf, num_warps=8)
    types = {"idx_ptr": "*i32", "nv_ptr": "*i32", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "hs_ptr": "*fp32"}
    floats = ("qk_scale", "sm_scale")
    sig = {n: "constexpr" if n in cons else (types.get(n, "*bf16") if n.endswith("_ptr")
                                             else "fp32" if n in floats else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in cons and n not in floats}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cons["num_warps"], maxnreg=loader.MAXNREG))
    ptx = kernel.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"),
            "cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
            "cp_async_arrive_noinc": ptx.count("cp.async.mbarrier.arrive.noinc"),
            # the partitions' register budgets, raised or lowered from the launch's
            "setmaxnreg": [int(x) for x in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)],
            "barrier_threads": sorted({int(x) for x in re.findall(r"bar\.sync\s+\d+, (\d+);", ptx)}),
            "shared": kernel.metadata.shared, "loader_regs": loader.LOADER_REGS.value}


def main():
    out = {f"forward {c}x{r}": build(c, r) for c, r in ((512, 64), (256, 32))}
    out["scores 512x64"] = build(512, 64, "scores")
    out["dq 512x64"] = build(512, 64, "dq")
    out["forward, keys as M, 16 heads 512x64"] = build(512, 64, "keys-as-M 16")
    out["forward, keys as M, 8 heads 256x32"] = build(256, 32, "keys-as-M 8")
    out["forward, keys as M, 32 heads 512x64"] = build(512, 64, "keys-as-M 32")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
