"""Command-line tools that read a run directory (its metrics.jsonl) after or during training.

    python -m pretrain.tools.report RUN_DIR          # one-paragraph summary (+ curves.png)
    python -m pretrain.tools.plot RUN_DIR... --out P # loss / throughput curves of one or more runs
    python -m pretrain.tools.dsa_report RUN_DIR      # DSA continued-pretraining table and plot

They import nothing from training: a run directory is all they need.
"""
