"""Multi-token prediction with depths sharing one layer (GLM-5 report, MTP; DeepSeek-V3 MTP).

Depth k = 1..D predicts token i + k + 1 from position i:

    h^0   = the main model's output hidden states (after its final norm)
    h^k_i = Layer( W_eh [ RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i) ] )
    p^k_i = softmax( Head( RMSNorm(h^k_i) ) )

Emb and Head are the main model's embedding and output layer. GLM-5 trains D = 3 depths with a
single set of MTP parameters (W_eh, the norms and the transformer layer), so one layer's weights
serve every depth and their gradient is the sum of the depths' contributions. megatron-core
0.16.1 builds one layer per depth; `mtp_use_repeated_layer=False` keeps that behaviour.

Under context parallelism t_{i+k} and the labels of depth k cross chunk boundaries: megatron's `roll_tensor`
exchanges the boundary tokens of the zigzag split; with a chunk assignment (`parallel.cp_chunk_assignment: work`)
`roll_left` shifts over the batch's own chunks (`parallel.context_parallel.roll_sequence`).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionLayer,
    roll_tensor,
)
from megatron.core.utils import make_viewless_tensor

from parallel.context_parallel import cp_size_and_rank, roll_sequence
from pretrain.model.documents import layout_assignment


def roll_left(tensor, cp_group, attention_mask=None, packed_seq_params=None):
    """Each token's successor (the last position's: 0) along the sequence, as megatron's `roll_tensor`, which takes
    the zigzag split under context parallelism; when the batch's document layout (`attention_mask`) carries a CP
    chunk assignment (`parallel.cp_chunk_assignment: work`), over that assignment (`roll_sequence`) -> (rolled, sum)."""
    assignment = layout_assignment(attention_mask, cp_size_and_rank(cp_group)[0])
    if assignment is None:
        return roll_tensor(tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    return roll_sequence(tensor, cp_group, assignment)


class ChunkAssignedMTPLayer(MultiTokenPredictionLayer):
    """megatron's MTP layer whose shift of the token ids and positions follows the batch's CP chunks (`roll_left`)."""

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, *args, **kwargs):
        self._attention_mask = attention_mask  # read by _get_embeddings within this call only
        try:
            return super().forward(input_ids, position_ids, hidden_states, attention_mask, *args, **kwargs)
        finally:
            self._attention_mask = None

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None):
        mask = getattr(self, "_attention_mask", None)
        if layout_assignment(mask, cp_size_and_rank(self.cp_group)[0]) is None:
            return super()._get_embeddings(input_ids, position_ids, embedding, hidden_states, packed_seq_params)
        input_ids, _ = roll_left(input_ids, self.cp_group, mask)
        position_ids, _ = roll_left(position_ids, self.cp_group, mask)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        return input_ids, position_ids, decoder_input, hidden_states


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
