"""The DSA sparse MLA kernels for Hopper (sm_90), warp-specialized, in Gluon (GLM-5 report, DSA section;
DeepSeek-V3.2 section 2). Same math, arguments and results as the Triton kernels of `kernels.sparse_mla`:

- `forward_heads_m`: the forward at 64 heads per rank, the heads as the MMA's M;
- `forward_keys_m`: the forward at 8-32 heads per rank, the selected keys as the MMA's M;
- `first_pass`: the backward's first pass at 64 heads (scores, dS and P stored per (token, slot)), and
  `query_gradient`: its dq from the stored dS;
- `loader`: what they share: the loader partition that gathers selected key rows into shared-memory stages, the
  forward programs' setup and epilogue, and `inputs_fit`, the tensor checks they need.

Which of them runs for a layer's heads and GPU is `kernels.plan.kernel_plan`'s decision.
"""
