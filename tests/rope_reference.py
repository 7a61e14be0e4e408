"""megatron-core's unfused MLA RoPE through its public `apply_rotary_pos_emb`: the reference of the fused kernel's
tests (tests/test_rope.py on CPU, tests/test_gpu_model.py on the GPU)."""

from types import SimpleNamespace

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

# the fields apply_rotary_pos_emb reads on its unfused bshd path; a CP group is read only for packed (thd) input
MLA = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=True)
NO_CP = object()


def megatron_rope(t, freqs, mscale=1.0):
    """t [s, b, heads, d] rotated on its first freqs.shape[-1] dims as megatron-core's MLA layer rotates it."""
    return apply_rotary_pos_emb(t, freqs, config=MLA, mscale=mscale, cp_group=NO_CP)
