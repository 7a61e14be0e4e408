"""GLM-5-style pretraining on megatron-core: model, configuration, conversion and training."""

import warnings

# megatron-core announces at import time that Transformer Engine / apex are absent and that it
# uses its torch fallbacks; that is the expected setup here (TE is optional), so keep logs clean.
for _message in (
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
    ".*full scope is deprecated.*",
    ".*moe_ffn_hidden_size is not set.*",
):
    warnings.filterwarnings("ignore", message=_message)
