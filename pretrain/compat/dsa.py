"""DSA's indexer-loss gradient scale (megatron-core 0.16.1; part of `pretrain.compat`).

megatron-core's `DSAIndexerLossAutoScaler` is the identity on the attention output; its backward
feeds d(indexer loss) = `main_loss_backward_scale` into the loss it carries. megatron-core scales
its other auxiliary losses (MoE, MTP) by 1 / (number of micro-batches) through their scalers'
`set_loss_scale`, but 0.16.1 never calls it for DSA: the scale stays 1 and the indexer gradient
grows with the number of micro-batches. The trainer therefore sets it every step
(`pretrain.training.loop`: fp16 loss scale / number of micro-batches), and the DSA layer attaches
its loss through this class.
"""

from __future__ import annotations

from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

from pretrain.compat.registry import Workaround

# Used as is: only its scale needs setting, which the trainer does through `set_loss_scale`.
IndexerLossAutoScaler = DSAIndexerLossAutoScaler

WORKAROUNDS = [
    Workaround(
        name="IndexerLossAutoScaler",
        target="megatron.core.transformer.experimental_attention_variant.dsa.DSAIndexerLossAutoScaler"
               ".main_loss_backward_scale",
        reason="megatron-core never sets the DSA indexer-loss scale: its gradient is not averaged over "
               "micro-batches; the trainer sets it every step",
        upstream="open",
        test="tests/test_dsa_model.py::test_indexer_gradient_follows_the_loss_scale",
        install=None,
    ),
]
