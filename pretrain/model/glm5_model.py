"""The GLM-5 model: megatron-core's `GPTModel` built from our specs, with depth-shared MTP.

The two places where megatron-core 0.16.1's `GPTModel` does not fit (its MTP block class, a forward
without labels under MTP) are `pretrain.compat` workarounds.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core.models.gpt import GPTModel

from parallel.context_parallel import cp_size_and_rank, global_token_count
from pretrain.compat import MTPLogitsWithoutLabels, gpt_model_mtp_block_class
from pretrain.model.dsa import link_shared_indexers
from pretrain.model.mtp import SharedDepthMTPBlock, roll_left
from pretrain.model.output_loss import head_loss


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

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, decoder_input=None,
                     attention_mask=None, inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                     runtime_gather_output=None, extra_block_kwargs=None, inference_context=None):
        """megatron-core's `_postprocess` with the output layer and loss fused (`model.output_loss_backend`).

        Same MTP arithmetic as megatron-core 0.16.1 (labels and mask rolled per depth, each depth's
        masked loss sum / tokens x mtp_loss_scaling_factor / depths through `MTPLossAutoScaler`), but no
        depth and no main head ever materializes [tokens, vocab] logits. Under context parallelism (any
        backend) the roll crosses chunk boundaries (megatron's `roll_tensor` exchanges the boundary
        tokens between CP ranks; `mtp.roll_left` follows a batch's chunk assignment) and each depth's loss is a
        token mean over the whole sequence: the rank's sum x cp / the token count summed over CP (DDP averages over
        DP x CP), where megatron would average the ranks' own means."""
        args = (hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin)
        kwargs = dict(mtp_in_postprocess=mtp_in_postprocess, loss_mask=loss_mask, decoder_input=decoder_input,
                      attention_mask=attention_mask, inference_params=inference_params,
                      packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                      runtime_gather_output=runtime_gather_output, extra_block_kwargs=extra_block_kwargs,
                      inference_context=inference_context)
        backend = self.config.output_loss_backend
        cp_size = cp_size_and_rank(self.cp_group)[0]
        if labels is None or (backend == "unfused" and cp_size == 1) or inference_context is not None:
            return super()._postprocess(*args, **kwargs)
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.multi_token_prediction import (
            MTPLossAutoScaler,
            MTPLossLoggingHelper,
        )

        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if mtp_in_postprocess:
            hidden_states = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                                     attention_mask=attention_mask, inference_params=inference_params,
                                     rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                     rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                                     sequence_len_offset=sequence_len_offset, embedding=self.embedding,
                                     **(extra_block_kwargs or {}))
        if not self.post_process:
            return hidden_states
        chunk = self.config.output_chunk_size
        if self.config.mtp_num_layers:
            depths = self.config.mtp_num_layers
            states = torch.chunk(hidden_states, 1 + depths, dim=0)
            hidden_states = states[0]
            mtp_labels = labels.clone()
            mtp_mask = torch.ones_like(mtp_labels) if loss_mask is None else loss_mask
            for depth in range(depths):
                mtp_labels, _ = roll_left(mtp_labels, self.cp_group, attention_mask, packed_seq_params)
                mtp_mask, num_tokens = roll_left(mtp_mask, self.cp_group, attention_mask, packed_seq_params)
                depth_sum, _ = self._head_loss(states[depth + 1], mtp_labels, mtp_mask, backend, chunk, weight)
                if cp_size > 1:
                    depth_sum, num_tokens = depth_sum * cp_size, global_token_count(num_tokens, self.cp_group)
                if self.training:
                    MTPLossLoggingHelper.save_loss_to_tracker(
                        depth_sum / num_tokens, depth, depths,
                        avg_group=ps.get_data_parallel_group(with_context_parallel=True))
                scale = self.config.mtp_loss_scaling_factor / depths
                hidden_states = MTPLossAutoScaler.apply(
                    hidden_states, scale * depth_sum if self.config.calculate_per_token_loss
                    else scale * depth_sum / num_tokens)
        _, per_token = self._head_loss(hidden_states, labels, loss_mask, backend, chunk, weight)
        return per_token

    def _head_loss(self, hidden, labels, loss_mask, backend: str, chunk, weight):
        """(sum_i m_i loss_i, per-token losses [b, s]): fused (`head_loss`), or megatron's logits + CE."""
        if backend != "unfused":
            return head_loss(self.output_layer, hidden, labels, loss_mask, backend, chunk, weight,
                             fp32_grad_weight=self.config.output_grad_weight_fp32)
        logits, _ = self.output_layer(hidden, weight=weight)
        per_token = self.compute_language_model_loss(labels, logits)
        mask = torch.ones_like(per_token) if loss_mask is None else loss_mask
        return (per_token * mask).sum(), per_token

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
