"""`parallel.nccl_communicator_config_path`: megatron-core's NCCL options per process group, checked at config time.

megatron-core's `initialize_model_parallel(nccl_communicator_config_path=...)` reads a YAML file that maps its
process-group names to NCCL communicator options and builds each named group with them. `max_ctas` bounds the
thread blocks (SMs) NCCL takes for the group's collectives: a data-parallel gradient reduce that runs beside
the backward pass then holds fewer of the SMs the backward's kernels need (docs/parallelism.md, ZeRO-2).
"""

from __future__ import annotations

import os
from typing import Optional

import yaml

from pretrain.config.errors import ConfigError, require

# megatron-core 0.16.1's process-group names (parallel_state.get_nccl_options) and the options it reads
NCCL_GROUPS = ("dp", "dp_cp", "intra_dp_cp", "cp", "hcp", "mp", "tp", "pp", "embd", "pos_embd", "tp_dp", "tp_dp_cp",
               "tp_cp", "ep", "ep_tp", "tp_ep_mp", "tp_ep_pp", "ep_dp", "intra_ep_dp", "inter_ep_dp",
               "intra_dist_opt_instance")
NCCL_INT_OPTIONS = ("cga_cluster_size", "max_ctas", "min_ctas")


def check_nccl_options(path: Optional[str]) -> None:
    """`parallel.nccl_communicator_config_path`: a YAML mapping of megatron's group names to the NCCL options
    megatron reads (`max_ctas`, `min_ctas`, `cga_cluster_size`: integers >= 1; `net_name`: ib or socket;
    `is_high_priority_stream`: a boolean)."""
    if path is None:
        return
    key = "parallel.nccl_communicator_config_path"
    require(os.path.isfile(path), f"{key}: no file {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            groups = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: {path} is not YAML ({str(err).splitlines()[0]})") from None
    require(isinstance(groups, dict) and groups, f"{key}: {path} must map process-group names to NCCL options")
    for group, options in groups.items():
        require(group in NCCL_GROUPS, f"{key}: {path}: unknown process group {group!r} (megatron-core's: "
                                      f"{', '.join(NCCL_GROUPS)})")
        require(isinstance(options, dict), f"{key}: {path}: {group} must map option names to values")
        for name, value in options.items():
            if name in NCCL_INT_OPTIONS:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                require(ok, f"{key}: {path}: {group}.{name} must be an integer >= 1, got {value!r}")
            elif name == "net_name":
                require(str(value).lower() in ("ib", "socket"), f"{key}: {path}: {group}.net_name must be ib or "
                                                               f"socket, got {value!r}")
            elif name == "is_high_priority_stream":
                require(isinstance(value, bool), f"{key}: {path}: {group}.{name} must be true or false")
            else:
                raise ConfigError(f"{key}: {path}: {group}.{name} is not an NCCL option megatron-core reads "
                                  f"({', '.join(NCCL_INT_OPTIONS)}, net_name, is_high_priority_stream)")
