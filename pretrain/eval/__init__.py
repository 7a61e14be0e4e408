"""Evaluations of a trained checkpoint: MTP speculative-decoding accept length (`mtp_accept`) and a
long-context key-value retrieval probe (`retrieval`); `python -m pretrain.eval.<name> --help`."""
