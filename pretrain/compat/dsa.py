"""DSA's indexer-loss gradient scale (megatron-core 0.16.1; part of `pretrain.compat`).

megatron-core's `DSAIndexerLossAutoScaler` is the identity on the attention output; its backward
feeds d(indexer loss) = `main_loss_backward_scale` into the loss it carries. megatron-core scales
its other auxiliary losses (MoE, MTP) by 1 / (number of micro-batches) through their scalers'
`set_loss_scale`, but 0.16.1 never calls it for DSA: the scale stays 1 and the indexer gradient
grows with the number of micro-batches. The trainer therefore sets it every step
(`pretrain.training.loop`: fp16 loss scale / number of micro-batches), and the DSA layer attaches
its loss through this class.

megatron-core 0.16.1's `TransformerConfig.__post_init__` also asserts context_parallel_size == 1 for
the "dsa" variant: its own DSAttention has no context parallelism. Ours does (the DSA layer
all-gathers the latent and the indexer keys over CP, `pretrain.model.dsa.layer`), so the config check
runs with CP hidden (`dsa_config_check_without_cp`), and the config keeps its CP size.
"""

from __future__ import annotations

import contextlib

from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

from pretrain.compat.registry import Workaround

# Used as is: only its scale needs setting, which the trainer does through `set_loss_scale`.
IndexerLossAutoScaler = DSAIndexerLossAutoScaler

@contextlib.contextmanager
def dsa_config_check_without_cp(config):
    """Around `TransformerConfig.__post_init__`: CP reads as 1 for a DSA config, then is restored."""
    cp = config.context_parallel_size
    if getattr(config, "experimental_attention_variant", None) == "dsa":
        config.context_parallel_size = 1
    try:
        yield
    finally:
        config.context_parallel_size = cp


WORKAROUNDS = [
    Workaround(
        name="dsa_config_check_without_cp",
        target="megatron.core.transformer.transformer_config.TransformerConfig.__post_init__",
        reason="asserts context_parallel_size == 1 for the dsa variant (megatron's DSAttention has no CP; ours has)",
        upstream="fixed in later megatron-core (DSA context parallelism by all-gather, Megatron-LM PR #6058)",
        test="tests/test_context_parallel.py::test_cp2_matches_single_rank",
        install=None,
    ),
    Workaround(
        name="IndexerLossAutoScaler",
        target="megatron.core.transformer.experimental_attention_variant.dsa.DSAIndexerLossAutoScaler"
               ".main_loss_backward_scale",
        reason="megatron-core never sets the DSA indexer-loss scale: its gradient is not averaged over "
               "micro-batches; the trainer sets it every step",
        upstream="open",
        test="tests/test_dsa_model_indexer_loss.py::test_indexer_gradient_follows_the_loss_scale",
        install=None,
    ),
]
