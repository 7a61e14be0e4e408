"""Shared by the ablation tests: a sweep file on the tiny model."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_sweep(tmp_path, body: str) -> Path:
    """A sweep file in `tmp_path` on glm5-tiny (1024 tokens per run, seed 1) with `body` appended."""
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {ROOT / 'configs/models/glm5-tiny.yaml'}\noutput_dir: runs/x\ntokens: 1024\n"
                    f"seeds: [1]\n{body}")
    return path
