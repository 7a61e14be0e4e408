"""Copy retrieval per length: `python -m pretrain.eval.retrieval --kind copy` under its own name, so a sweep can
ask for it beside key-value retrieval (`report.evals: {retrieval: [...], retrieval_copy: [...]}`).

    python -m pretrain.eval.retrieval_copy --checkpoint CKPT --lengths 512 1024 2048 [--samples 50]

A probe repeats the first tokens of a random token span placed earlier in held-out text; the model must continue it
(`data_pipeline.retrieval_probe`, kind copy). Metrics: `copy@L` (every answer token greedy-right) and `copy_nll@L`.
"""

from __future__ import annotations

import sys

from pretrain.eval.retrieval import main as retrieval_main


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--kind" in args or any(a.startswith("--kind=") for a in args):
        print("retrieval_copy: --kind is copy here (use pretrain.eval.retrieval for the other kinds)", file=sys.stderr)
        return 2
    return retrieval_main(["--kind", "copy", *args], prog="python -m pretrain.eval.retrieval_copy")


if __name__ == "__main__":
    sys.exit(main())
