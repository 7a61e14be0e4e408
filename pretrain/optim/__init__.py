"""The optimizer's one home: Muon with Muon Split (`muon`), which update each GLM-5 parameter takes
(`roles`), ZeRO-2 gradient ownership and reduction (`zero2_grads`, its buckets `zero2_buckets` and
`zero2_scatter`, the copy-engine transport `zero2_copy_engine`) and its owner-side optimizer
(`zero2_owner`), the step clipped by the loop's gradient norm (`clipped_step`), and the builder that
decides data-parallel wrapping and optimizer together (`build`).
"""

from pretrain.optim.build import (
    OPTIMIZERS,
    build_optimizer,
    build_scheduler,
    data_parallel_mode,
    optimizer_entry,
    register_optimizer,
    wrap_model_chunks,
)
from pretrain.optim.clipped_step import step_with_norm
from pretrain.optim.muon import Muon, MuonSplit, newton_schulz, orthogonalized_update, sharded_orthogonalized_update
from pretrain.optim.roles import (
    build_muon_optimizer,
    inner_to_model_params,
    muon_roles,
    ownership_cost,
    param_role,
    param_split,
    sub_optimizers,
)
from pretrain.optim.zero2_buckets import assign_owners
from pretrain.optim.zero2_grads import Zero2DataParallel
from pretrain.optim.zero2_owner import shard_optimizer

__all__ = [
    "OPTIMIZERS",
    "Muon",
    "MuonSplit",
    "Zero2DataParallel",
    "assign_owners",
    "build_muon_optimizer",
    "build_optimizer",
    "build_scheduler",
    "data_parallel_mode",
    "inner_to_model_params",
    "muon_roles",
    "newton_schulz",
    "optimizer_entry",
    "orthogonalized_update",
    "ownership_cost",
    "param_role",
    "param_split",
    "register_optimizer",
    "shard_optimizer",
    "sharded_orthogonalized_update",
    "step_with_norm",
    "sub_optimizers",
    "wrap_model_chunks",
]
