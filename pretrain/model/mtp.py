"""Multi-token prediction with depths sharing one layer (GLM-5 report, MTP; DeepSeek-V3 MTP).

Depth k = 1..D predicts token i + k + 1 from position i:

    h^0   = the main model's output hidden states (after its final norm)
    h^k_i = Layer( W_eh [ RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i) ] )
    p^k_i = softmax( Head( RMSNorm(h^k_i) ) )

Emb and Head are the main model's embedding and output layer. GLM-5 trains D = 3 depths with a
single set of MTP parameters (W_eh, the norms and the transformer layer), so one layer's weights
serve every depth and their gradient is the sum of the depths' contributions. megatron-core
0.16.1 builds one layer per depth; `mtp_use_repeated_layer=False` keeps that behaviour.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock


class SharedDepthMTPBlock(MultiTokenPredictionBlock):
    """`MultiTokenPredictionBlock` whose depths may reuse one layer.

    With `mtp_use_repeated_layer` the spec holds a single layer and `forward` applies it
    `mtp_num_layers` times; otherwise it holds one layer per depth, as megatron does.
    """

    def layer_for_depth(self, depth: int):
        return self.layers[0] if self.config.mtp_use_repeated_layer else self.layers[depth]

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, embedding=None, **kwargs):
        # Output: [(1 + D) * s, b, h], the main hidden states followed by each depth's, which
        # GPTModel splits to compute the per-depth losses.
        kwargs.pop("context", None)
        kwargs.pop("context_mask", None)
        extra = kwargs.pop("extra_block_kwargs", None) or {}
        outputs = [hidden_states]
        for depth in range(self.config.mtp_num_layers):
            hidden_states, input_ids, position_ids = self.layer_for_depth(depth)(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                embedding=embedding,
                **kwargs,
                **extra,
            )
            outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)
