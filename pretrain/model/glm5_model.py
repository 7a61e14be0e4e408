"""The GLM-5 model: megatron-core's `GPTModel` built from our specs, with depth-shared MTP.

The two places where megatron-core 0.16.1's `GPTModel` does not fit (its MTP block class, a forward
without labels under MTP) are `pretrain.compat` workarounds.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core.models.gpt import GPTModel

from pretrain.compat import MTPLogitsWithoutLabels, gpt_model_mtp_block_class
from pretrain.model.dsa import link_shared_indexers
from pretrain.model.mtp import SharedDepthMTPBlock


class GLM5Model(MTPLogitsWithoutLabels, GPTModel):
    """`GPTModel` whose MTP block may share one layer across depths.

    forward(input_ids, position_ids, attention_mask, labels=None) returns logits
    [batch, seq, vocab / TP] without labels, and the per-token LM loss [batch, seq] with labels;
    with labels and MTP, each depth's loss is added to the gradient (scaled by
    `mtp_loss_scaling_factor / mtp_num_layers`) and tracked for logging, as in megatron-core.
    """

    def __init__(self, *args, **kwargs):
        with gpt_model_mtp_block_class(SharedDepthMTPBlock):
            super().__init__(*args, **kwargs)
        if getattr(self, "decoder", None) is not None:
            link_shared_indexers(self.decoder)

    def output_logits(self, hidden_states: torch.Tensor, runtime_gather_output=None) -> torch.Tensor:
        """Final hidden states [s, b, h] (after the final norm) -> logits [b, s, v]."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1).contiguous()

    @torch.no_grad()
    def mtp_logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> List[torch.Tensor]:
        """Logits of the main head and of each MTP depth, [b, s, v] each (single stage)."""
        if not (self.pre_process and self.post_process and self.mtp_process):
            raise RuntimeError("mtp_logits needs the whole model (and its MTP block) on this rank")
        decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary = self.rotary_pos_emb(decoder_input.size(0)) if self.position_embedding_type == "rope" else None
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary)
        hidden = self.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=hidden,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary,
            embedding=self.embedding,
        )
        return [self.output_logits(h) for h in torch.chunk(hidden, 1 + self.config.mtp_num_layers, dim=0)]
