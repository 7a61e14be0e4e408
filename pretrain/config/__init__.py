"""GLM-5 configuration: typed sections whose fields carry their choices (`Literal`) and a one-line
docstring (schema, read by field_docs), YAML loading with `base:` chains and dotted overrides (loader),
the type check of every value (types), and the rules between values with actionable errors (validation)."""

from pretrain.config.errors import ConfigError
from pretrain.config.field_docs import field_docs
from pretrain.config.loader import config_from_dict, config_to_dict, load_config, save_config
from pretrain.config.moe_pattern import moe_layer_pattern, parse_moe_layer_freq
from pretrain.config.schema import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    GLM5Config,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from pretrain.config.validation import validate_config

__all__ = [
    "ConfigError",
    "field_docs",
    "GLM5Config",
    "ModelConfig",
    "ParallelConfig",
    "OptimizerConfig",
    "DataConfig",
    "TrainConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "SECTIONS",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "save_config",
    "validate_config",
    "moe_layer_pattern",
    "parse_moe_layer_freq",
]
