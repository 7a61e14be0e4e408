"""Config-driven ablations: a sweep file (`sweep.py`) names a base config, variants as dotted
overrides, seeds and a token budget; `runner.py` trains every variant x seed through the normal
training entry and resumes or skips what an earlier invocation did; `report.py` collects the
table and the loss curves.

    python -m pretrain.ablate configs/ablations/attention.yaml [--dry-run] [--only NAME ...]
"""
