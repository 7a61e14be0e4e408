"""Training: the megatron-core loop, optimizer, checkpoints, FLOP counting, metrics and profiling."""
