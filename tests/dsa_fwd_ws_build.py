"""Compile the warp-specialized sparse MLA kernels (the forwards, `sparse_mla_fwd_ws` and, for 8-32 heads,
`sparse_mla_fwd_km`; the backward's first pass,
`sparse_mla_bwd_ws`, and its query gradient, `sparse_mla_dq_ws`) for sm_90 without a GPU (Triton's bundled ptxas)
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

from pretrain.model.dsa.kernels import sparse_mla_bwd_ws as bws
from pretrain.model.dsa.kernels import sparse_mla_dq_ws as dqws
from pretrain.model.dsa.kernels import sparse_mla_fwd_km as km
from pretrain.model.dsa.kernels import sparse_mla_fwd_ws as ws


def build(c: int, r: int, kernel: str = "forward") -> dict:
    if kernel == "scores":  # two score warp groups of 4 warps and the loader; one stage each
        fn, cons = bws.scores_kernel, dict(H=64, C=c, R=r, BN=bws.CONFIG[0], HEAD_SUMS=True, num_warps=4)
    elif kernel.startswith("keys-as-M"):  # 8-32 heads: one consumer warp group and the loader
        (bn, nbuf), h = km.CONFIG, int(kernel.split()[-1])
        fn, cons = km.fwd_kernel, dict(H=h, C=c, R=r, BN=bn, NBUF=nbuf, num_warps=km.CONSUMER_WARPS)
    else:
        fn, (bn, nbuf) = (dqws.dq_kernel, dqws.CONFIG) if kernel == "dq" else (ws.fwd_kernel, ws.CONFIG)
        cons = dict(H=64, C=c, R=r, BN=bn, NBUF=nbuf, num_warps=8)
    types = {"idx_ptr": "*i32", "nv_ptr": "*i32", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "hs_ptr": "*fp32"}
    floats = ("qk_scale", "sm_scale")
    sig = {n: "constexpr" if n in cons else (types.get(n, "*bf16") if n.endswith("_ptr")
                                             else "fp32" if n in floats else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in cons and n not in floats}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cons["num_warps"], maxnreg=ws.MAXNREG))
    ptx = kernel.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"),
            "cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
            "cp_async_arrive_noinc": ptx.count("cp.async.mbarrier.arrive.noinc"),
            # the partitions' register budgets, raised or lowered from the launch's
            "setmaxnreg": [int(x) for x in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)],
            "barrier_threads": sorted({int(x) for x in re.findall(r"bar\.sync\s+\d+, (\d+);", ptx)}),
            "shared": kernel.metadata.shared, "loader_regs": ws.LOADER_REGS.value}


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
