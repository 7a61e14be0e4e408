"""Optimizers GLM-5 trains with that megatron-core 0.16.1 does not provide for Python 3.11."""

from pretrain.optim.muon import Muon, MuonSplit, mla_splits, newton_schulz, orthogonalized_update

__all__ = ["Muon", "MuonSplit", "mla_splits", "newton_schulz", "orthogonalized_update"]
