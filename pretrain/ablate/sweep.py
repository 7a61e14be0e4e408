"""Sweep files: a base config, variants as dotted overrides, seeds and a token budget.

    base: ../models/glm5-ablate.yaml        # relative to the sweep file, like a config's `base:`
    output_dir: runs/ablations/attention    # relative to the repository root; one run dir per variant x seed
    tokens: 400_000_000                     # per run: train.train_iters = ceil(tokens / (global_batch * seq_length))
    seeds: [1234, 1235]
    launcher: torchrun                      # torchrun (launch/train.sh) | python (python -m pretrain.train)
    nproc_per_node: 1
    overrides: [checkpoint.save_interval=100]   # applied to every variant, before its own
    report:
      average_last: 20                      # steps averaged for the "avg train loss" column
      evals:                                # run on each finished run's checkpoint, in the table
        mtp_accept: [--draft-tokens, "3"]
    variants:
      - name: mla
        overrides: [optimizer.muon_split=false]
      - name: dense-pretrain
        report: false                       # trained (others start from it), left out of the table
      - name: dsa
        base: ../dsa/other.yaml             # a variant may name its own base
        tokens: 100_000_000                 # and its own budget,
        seeds: [1234]                       # seeds (a subset of the sweep's)
        evals: {}                           # and evaluations (replacing report.evals)
        overrides: ["checkpoint.pretrained={checkpoint:dense-pretrain}"]

`{checkpoint:NAME}` stands for the checkpoint directory of variant NAME's run with the same seed;
NAME must come earlier in the list. Every variant x seed config is built with the project's config
loader when the sweep is read, so an unknown key, a bad value, a duplicate name or a missing base
fails before any run, with one line.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

from pretrain.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("torchrun", "python")
EVALS = ("mtp_accept", "retrieval", "retrieval_copy")
_SWEEP_KEYS = {"base", "output_dir", "tokens", "seeds", "launcher", "nproc_per_node", "overrides", "report", "variants"}
_VARIANT_KEYS = {"name", "base", "overrides", "tokens", "report", "seeds", "evals"}
_REPORT_KEYS = {"average_last", "evals"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_CHECKPOINT_REF = re.compile(r"\{checkpoint:([^}]*)\}")
# Keys the runner sets for every run; a sweep that sets them too would be silently overridden.
_RUNNER_KEYS = ("train.seed", "train.train_iters", "logging.run_dir", "checkpoint.save", "checkpoint.auto_resume")


class SweepError(ValueError):
    """A sweep file that cannot run; the message is one line."""


@dataclass
class Run:
    variant: str
    seed: int
    run_dir: Path
    config_path: Path
    overrides: List[str]
    train_iters: int
    depends_on: Optional[str] = None  # variant whose same-seed run must finish first

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


@dataclass
class Variant:
    name: str
    base: Path
    overrides: List[str]
    tokens: int
    seeds: List[int]
    evals: Optional[Dict[str, List[str]]] = None  # None: the sweep's report.evals
    report: bool = True


@dataclass
class Sweep:
    path: Path
    output_dir: Path
    seeds: List[int]
    launcher: str
    nproc_per_node: Optional[int]
    variants: List[Variant]
    average_last: int = 10
    evals: Dict[str, List[str]] = field(default_factory=dict)
    runs: List[Run] = field(default_factory=list)

    def runs_of(self, variant: str) -> List[Run]:
        return [r for r in self.runs if r.variant == variant]


def rel(path: Path) -> str:
    """`path` relative to the repository root when inside it (commands run from the root)."""
    path = Path(os.path.abspath(path))
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SweepError(message)


def _int(value, what: str) -> int:
    if isinstance(value, str):
        value = value.replace("_", "")
        _require(value.isdigit(), f"{what} must be a positive integer, got {value!r}")
        value = int(value)
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{what} must be a positive integer, got {value!r}")
    return value


def _strings(value, what: str) -> List[str]:
    if value is None:
        return []
    _require(isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value),
             f"{what} must be a list of strings, got {value!r}")
    return [str(v) for v in value]


def _unknown(keys, allowed, where: str) -> None:
    extra = sorted(set(keys) - allowed)
    if extra:
        raise SweepError(f"unknown key {extra[0]!r} in {where}; allowed: {', '.join(sorted(allowed))}")


def is_sweep_file(path) -> bool:
    """True for a sweep file (it lists `variants`), as opposed to a training config."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(doc, dict) and "variants" in doc


def load_sweep(path, output_dir: Optional[Path] = None) -> Sweep:
    """Read and validate a sweep file; every run's config is built (and checked) here."""
    path = Path(path)
    _require(path.is_file(), f"sweep file not found: {path}")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise SweepError(f"cannot parse {path}: {' '.join(str(e).split())}") from None
    _require(isinstance(doc, dict), f"{path} must be a YAML mapping")
    _unknown(doc, _SWEEP_KEYS, str(path))
    for key in ("base", "output_dir", "tokens", "seeds", "variants"):
        _require(key in doc, f"{path} has no {key!r}")
    launcher = doc.get("launcher", "torchrun")
    _require(launcher in LAUNCHERS, f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    nproc = doc.get("nproc_per_node")
    nproc = None if nproc is None else _int(nproc, "nproc_per_node")
    _require(launcher == "torchrun" or nproc in (None, 1), "launcher python runs one process: drop nproc_per_node")
    seeds = doc["seeds"]
    _require(isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds),
             f"seeds must be a non-empty list of integers, got {seeds!r}")
    _require(len(set(seeds)) == len(seeds), f"seed listed twice in {seeds}")
    report = doc.get("report") or {}
    _require(isinstance(report, dict), "report must be a mapping")
    _unknown(report, _REPORT_KEYS, "report")
    common = _strings(doc.get("overrides"), "overrides")
    sweep = Sweep(
        path=path,
        output_dir=Path(output_dir) if output_dir is not None else ROOT / str(doc["output_dir"]),
        seeds=list(seeds),
        launcher=launcher,
        nproc_per_node=nproc,
        variants=_variants(doc, path, common, seeds),
        average_last=_int(report.get("average_last", 10), "report.average_last"),
        evals=_evals(report.get("evals"), "report.evals"),
    )
    sweep.runs = [_make_run(sweep, v, seed) for seed in sweep.seeds for v in sweep.variants if seed in v.seeds]
    return sweep


def _evals(raw, where: str) -> Dict[str, List[str]]:
    raw = raw or {}
    _require(isinstance(raw, dict), f"{where} must map an evaluation name to its arguments")
    for name in raw:
        _require(name in EVALS, f"unknown evaluation {name!r} in {where}; allowed: {', '.join(EVALS)}")
    return {name: _strings(args, f"{where}.{name}") for name, args in raw.items()}


def _variants(doc: dict, path: Path, common: List[str], sweep_seeds: List[int]) -> List[Variant]:
    raw = doc["variants"]
    _require(isinstance(raw, list) and raw, "variants must be a non-empty list")
    seen, out = set(), []
    for i, item in enumerate(raw):
        _require(isinstance(item, dict) and "name" in item, f"variant #{i + 1} must be a mapping with a name")
        name = str(item["name"])
        _unknown(item, _VARIANT_KEYS, f"variant {name}")
        _require(bool(_NAME_RE.match(name)), f"variant name {name!r}: use letters, digits, '_', '.', '+', '-'")
        _require(name not in seen, f"variant name {name!r} appears twice")
        seen.add(name)
        base = path.parent / str(item.get("base", doc["base"]))
        _require(base.is_file(), f"variant {name}: base config not found: {rel(base)}")
        overrides = common + _strings(item.get("overrides"), f"variant {name} overrides")
        for o in overrides:
            key = o.partition("=")[0].strip()
            _require(key not in _RUNNER_KEYS, f"variant {name}: {key} is set by the sweep runner; remove {o!r}")
            for ref in _CHECKPOINT_REF.findall(o):
                _require(ref in seen and ref != name,
                         f"variant {name}: {{checkpoint:{ref}}} must name an earlier variant")
        tokens = _int(item.get("tokens", doc["tokens"]), f"variant {name} tokens")
        seeds = item.get("seeds", sweep_seeds)
        _require(isinstance(seeds, list) and seeds and set(seeds) <= set(sweep_seeds),
                 f"variant {name}: seeds must be a non-empty subset of the sweep's seeds {sweep_seeds}")
        for ref in {r for o in overrides for r in _CHECKPOINT_REF.findall(o)}:
            source = next(v for v in out if v.name == ref)
            _require(set(seeds) <= set(source.seeds), f"variant {name}: seeds {seeds} must be among those of {ref}, "
                     f"whose checkpoints it starts from ({source.seeds})")
        evals = _evals(item["evals"], f"variant {name} evals") if "evals" in item else None
        out.append(Variant(name, base, overrides, tokens, seeds, evals, bool(item.get("report", True))))
    return out


def _make_run(sweep: Sweep, variant: Variant, seed: int) -> Run:
    run_dir = sweep.output_dir / variant.name / f"seed{seed}"
    depends = None
    overrides = []
    for o in variant.overrides:
        for ref in _CHECKPOINT_REF.findall(o):
            depends = ref
            o = o.replace(f"{{checkpoint:{ref}}}", rel(sweep.output_dir / ref / f"seed{seed}" / "checkpoints"))
        overrides.append(o)
    where = f"variant {variant.name} (seed {seed})"
    try:
        cfg = load_config(variant.base, overrides)
    except ConfigError as e:
        raise SweepError(f"{where}: {e}") from None
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_length
    iters = math.ceil(variant.tokens / tokens_per_step)
    run_overrides = overrides + [
        f"train.seed={seed}", f"train.train_iters={iters}",
        f"logging.run_dir={rel(run_dir)}", f"checkpoint.save={rel(run_dir / 'checkpoints')}",
        "checkpoint.auto_resume=true",
    ]
    try:  # once more with what the runner adds (train_iters vs eval/save intervals, LR schedule)
        load_config(variant.base, run_overrides)
    except ConfigError as e:
        raise SweepError(f"{where}: {e}") from None
    return Run(variant.name, seed, run_dir, variant.base, run_overrides, iters, depends)


def select(sweep: Sweep, only: Sequence[str], seeds: Sequence[int] = ()) -> List[Run]:
    """The runs of the variants named in `only` and the seeds in `seeds` (all when empty), in sweep order."""
    names = [v.name for v in sweep.variants]
    for name in only:
        _require(name in names, f"--only {name}: no such variant; variants: {', '.join(names)}")
    for seed in seeds:
        _require(seed in sweep.seeds, f"--seeds {seed}: not a seed of this sweep ({sweep.seeds})")
    return [r for r in sweep.runs if (not only or r.variant in only) and (not seeds or r.seed in seeds)]
