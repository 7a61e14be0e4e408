"""The layout planner: which parallel layout fits a GLM-5 model on a cluster, how fast it runs, and
how long the run takes (docs/layout.md).

    python -m pretrain.layout --config configs/models/glm5-744b.yaml --seq 4096 --global-batch 2048 \
        --cluster h100-nvl-ib400 --gpus 2048 --top 5

A layout (`types.Layout`) splits the world W = TP x PP x CP x DP, with expert parallelism EP x ETP carved
out of TP x CP x DP, PP stages holding L / (PP x VPP) layers per virtual chunk. For each candidate:

- memory per GPU (`memory.py`): weights (bf16 model copy, fp32 main copy), fp32 gradient buffers,
  optimizer state (AdamW 2 x fp32; Muon 1 x fp32 momentum on matrices, AdamW on the rest), divided
  by what the layout shards (TP/PP/EP/ETP for parameters, DP under ZeRO-2), plus activations per
  micro-batch per layer (by recompute/offload) times the micro-batches in flight on the first stage
  (1F1B: PP; interleaved: megatron's PP x (1 + (PP - 1) / (PP x VPP))), the embedding on the first
  stage, MTP and the output loss on the last, and communication buffers;
- host memory per node (`host_memory.py`): the trainers, a checkpoint save's kept pinned staging and the
  activations offloading sends to the host;
- pipeline bubble (PP - 1) / (VPP x m), with m micro-batches per pipeline per step;
- time per step (`timing.py`, calibrated per GPU kind), hence tokens/s per GPU and MFU.

The search (`search.py`) enumerates the factorizations of the GPU count, refuses a layout with a
one-line reason (divisibility, memory over (1 - headroom) of the GPU or of the node's host memory, bubble
over a bound, a layout the config validator refuses) and ranks the rest by predicted tokens/s per GPU.
"""
