"""A curriculum plan: the stages of one run, each an ordinary training config, validated as a whole.

    name: tiny                              # optional; default: the file's name
    run_dir: runs/curriculum-tiny           # stage s writes <run_dir>/<s>/ (metrics, checkpoints, config.yaml)
    optimizer_state: fresh                  # or carry: each stage continues the previous stage's optimizer state
    pretrained: null                        # weights the first stage starts from (null: fresh initialization)
    prune_checkpoints: false                # true: delete a stage's checkpoints once the stage after it has finished
    defaults:                               # config keys for every stage, nested by section like a config file
      train: {micro_batch_size: 1}
    stages:
      - name: ctx256
        config: ../models/glm5-tiny.yaml    # the stage's base config, relative to the plan file
        seq_length: 256                     # the stage's context length (data.seq_length)
        tokens: 16384                       # token budget: train.train_iters = ceil(tokens / batch_tokens)
        batch_tokens: 2048                  # tokens per optimizer step: train.global_batch_size = batch_tokens / seq_length
        optimizer_state: fresh              # optional, overrides the plan's choice at this stage boundary
        overrides:                          # this stage's config keys (LR schedule, RoPE base, data blend, layout, ...)
          model: {rotary_base: 10000.0}

A stage's config is `config`, then `defaults`, then its `overrides`, then the command line's
`section.key=value` overrides (every stage), then the keys the runner owns, which a plan may not
set: `data.seq_length`, `train.train_iters`, `train.global_batch_size`, `checkpoint.save` /
`load` / `pretrained` / `pretrained_optimizer` and `logging.run_dir`. Stage i > 0 starts from the
newest checkpoint of stage i-1 (`checkpoint.pretrained`); with `optimizer_state: carry` also from
its optimizer state (`checkpoint.pretrained_optimizer`: Adam moments / Muon momentum continue, the
LR schedule and the data order are the stage's own). Carrying needs the same optimizer and the same
trainable parameters on both sides, so the DSA warm-up (indexer only) and the stage after it start
fresh, and say so (`optimizer_state: fresh`). The architecture must stay the same across stages
(the weights are loaded), except that DSA indexer weights may appear (initialized fresh).

Every stage's config is built with `pretrain.config.load_config` (so every config rule applies)
before any stage runs; a bad plan is one line of `PlanError` naming the plan, the stage and the key.
`check_plan_data` then checks every stage's data files (the command line does, before it validates or
runs a plan, unless `--skip-data-check` is given for a plan whose data lives where it will run).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence

from omegaconf import OmegaConf

from pretrain.config import ConfigError, load_config
from pretrain.config.schema import SECTIONS, GLM5Config

OptimizerState = Literal["fresh", "carry"]
PLAN_KEYS = ("name", "run_dir", "optimizer_state", "pretrained", "prune_checkpoints", "defaults", "stages")
STAGE_KEYS = ("name", "config", "seq_length", "tokens", "batch_tokens", "optimizer_state", "overrides")
# Keys the runner sets for every stage; a plan or override that sets them is refused.
RUNNER_KEYS = ("data.seq_length", "train.train_iters", "train.global_batch_size", "checkpoint.save",
               "checkpoint.load", "checkpoint.pretrained", "checkpoint.pretrained_optimizer", "logging.run_dir")
# Model keys that shape parameters: the next stage loads the previous stage's weights.
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                     "share_embeddings_and_output_weights", "multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                     "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_query_groups", "kv_channels",
                     "num_moe_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "mtp_num_layers", "mtp_use_repeated_layer", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
                     "dsa_indexer_types", "add_bias_linear", "normalization")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
CHECKPOINTS = "checkpoints"  # a stage's checkpoint folder inside its directory


class PlanError(ConfigError):
    """A plan that cannot run; the message is one line naming the plan, the stage and the key."""


@dataclass
class Stage:
    name: str
    config_path: str
    seq_length: int
    tokens: int
    batch_tokens: int
    optimizer_state: OptimizerState
    overrides: List[str]
    directory: Path
    global_batch_size: int = 0
    train_iters: int = 0
    cfg: Optional[GLM5Config] = None

    @property
    def checkpoints(self) -> str:
        return str(self.directory / CHECKPOINTS)

    @property
    def trained_tokens(self) -> int:
        """Tokens the stage trains on: its budget rounded up to whole steps."""
        return self.train_iters * self.global_batch_size * self.seq_length


@dataclass
class Plan:
    path: str
    name: str
    run_dir: Path
    optimizer_state: OptimizerState
    pretrained: Optional[str]
    prune_checkpoints: bool = False
    stages: List[Stage] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"plan {self.name} ({self.path}): {len(self.stages)} stages in {self.run_dir}, "
                 f"optimizer state {self.optimizer_state} across stage boundaries"]
        for i, s in enumerate(self.stages):
            c = s.cfg
            start = "fresh init" if i == 0 and not self.pretrained else f"from {c.checkpoint.pretrained}"
            lines.append(
                f"  {i + 1}. {s.name}: seq {s.seq_length:,}, {s.train_iters:,} steps x {s.global_batch_size} seqs "
                f"= {s.trained_tokens:,} tokens, lr {c.optimizer.lr:g}->{c.optimizer.min_lr:g} "
                f"{c.optimizer.lr_decay_style}, rope base {c.model.rotary_base:g}, "
                f"layout TP{c.parallel.tensor_model_parallel_size} PP{c.parallel.pipeline_model_parallel_size} "
                f"CP{c.parallel.context_parallel_size} EP{c.parallel.expert_model_parallel_size}, "
                f"DSA {_dsa_mode(c)}, {start}, optimizer {s.optimizer_state}")
        return "\n".join(lines)


def _dsa_mode(cfg: GLM5Config) -> str:
    m = cfg.model
    if m.experimental_attention_variant != "dsa":
        return "absent"
    if m.dsa_sparse_attention:
        return "sparse"
    if cfg.train.trainable_params == "dsa_indexer":
        return "warm-up"
    return "indexer trained" if m.dsa_indexer_loss_coeff > 0 else "off"


# ------------------------------------------------------------------------------------- loading
def load_plan(path: str, overrides: Sequence[str] = ()) -> Plan:
    """Read, resolve and validate a plan; every stage's config is built. Raises PlanError (one line)."""
    doc = _read(path)
    plan_overrides = [o for o in overrides if "." not in o.partition("=")[0]]
    config_overrides = [o for o in overrides if "." in o.partition("=")[0]]
    for item in plan_overrides:
        key, eq, text = item.partition("=")
        if not eq or key not in PLAN_KEYS or key in ("stages", "defaults"):
            allowed = ", ".join(k for k in PLAN_KEYS if k not in ("stages", "defaults"))
            raise PlanError(f"bad override {item!r}: write KEY=VALUE for a plan key ({allowed}) or "
                            "section.key=value for every stage's config")
        doc[key] = _parse_value(text)
    _check_owned(config_overrides, f"override of plan {path}")
    _check_keys(doc, PLAN_KEYS, f"plan {path}")
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise PlanError(f"plan {path}: 'stages' must be a non-empty list of stages")
    plan = Plan(path=str(path), name=str(doc.get("name") or Path(path).stem),
                run_dir=Path(_required(doc, "run_dir", f"plan {path}", str)),
                optimizer_state=_optimizer_state(doc.get("optimizer_state", "fresh"), f"plan {path}"),
                pretrained=doc.get("pretrained"), prune_checkpoints=doc.get("prune_checkpoints", False))
    if not isinstance(plan.prune_checkpoints, bool):
        raise PlanError(f"plan {path}: prune_checkpoints must be true or false, got {plan.prune_checkpoints!r}")
    defaults = _dotted(doc.get("defaults") or {}, f"plan {path}: defaults")
    _check_owned(defaults, f"plan {path}: defaults")
    seen = set()
    for i, raw in enumerate(stages):
        stage = _stage(plan, i, raw, Path(path).parent)
        if stage.name in seen:
            raise PlanError(f"plan {path}: two stages are named {stage.name!r}; stage names must be unique")
        seen.add(stage.name)
        stage.cfg = _stage_config(plan, stage, defaults + stage.overrides + config_overrides)
        plan.stages.append(stage)
    _check_transitions(plan)
    return plan


def check_plan_data(plan: Plan) -> int:
    """The data files of every stage, as each stage's run checks them before it starts
    (`pretrain.training.preflight.check_data`: prefixes, tokenizer, documents per split after
    `data.min_document_length`, for the stage's own step count): a bad path in the last stage fails
    now, not after the stages before it have trained. Returns how many stages read files (mock: none).
    Raises PlanError (one line: plan, stage, key, file)."""
    from pretrain.training.preflight import check_data

    checked = 0
    for stage in plan.stages:
        try:
            check_data(stage.cfg)
        except ConfigError as err:
            raise PlanError(f"plan {plan.path}, stage {stage.name}: {err}") from None
        checked += not stage.cfg.data.mock
    return checked


def _read(path: str) -> Dict[str, Any]:
    if not Path(path).is_file():
        raise PlanError(f"plan file not found: {path}")
    try:
        doc = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # YAML syntax, duplicate keys
        raise PlanError(f"cannot parse plan {path}: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict):
        raise PlanError(f"plan {path} must be a YAML mapping with run_dir and stages")
    return doc


def _parse_value(text: str) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]
    except Exception:
        return text


def _check_keys(doc: Dict[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in doc:
        if key not in allowed:
            raise PlanError(f"{where}: unknown key {key!r}; allowed: {', '.join(allowed)}")


def _required(doc: Dict[str, Any], key: str, where: str, kind: type) -> Any:
    value = doc.get(key)
    if value is None:
        raise PlanError(f"{where}: '{key}' is required")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise PlanError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise PlanError(f"{where}: '{key}' must be a string, got {value!r}")
    return value


def _optimizer_state(value: Any, where: str) -> OptimizerState:
    if value not in ("fresh", "carry"):
        raise PlanError(f"{where}: optimizer_state must be 'fresh' or 'carry', got {value!r}")
    return value


def _dotted(mapping: Any, where: str) -> List[str]:
    """`{section: {key: value}}` as `section.key=value` overrides (values as JSON, which YAML reads back)."""
    if not isinstance(mapping, dict):
        raise PlanError(f"{where} must be a mapping of config sections, got {mapping!r}")
    out = []
    for section, body in mapping.items():
        if section not in SECTIONS:
            raise PlanError(f"{where}: unknown config section {section!r}; sections: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise PlanError(f"{where}: section {section} must be a mapping of keys, got {body!r}")
        out += [f"{section}.{key}={json.dumps(value)}" for key, value in body.items()]
    return out


def _check_owned(overrides: Sequence[str], where: str) -> None:
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in RUNNER_KEYS:
            raise PlanError(f"{where}: {key} is set by the curriculum runner (context length: seq_length, budget: "
                            "tokens and batch_tokens, paths: run_dir and pretrained); remove it")


def _stage(plan: Plan, index: int, raw: Any, plan_dir: Path) -> Stage:
    where = f"plan {plan.path}, stage {index + 1}"
    if not isinstance(raw, dict):
        raise PlanError(f"{where} must be a mapping with name, config, seq_length, tokens, batch_tokens")
    name = _required(raw, "name", where, str)
    where = f"plan {plan.path}, stage {name}"
    _check_keys(raw, STAGE_KEYS, where)
    if not _NAME.match(name):
        raise PlanError(f"{where}: the name must be letters, digits, '.', '_' or '-' (it names a directory)")
    config = plan_dir / _required(raw, "config", where, str)
    seq, tokens, batch = (_required(raw, k, where, int) for k in ("seq_length", "tokens", "batch_tokens"))
    if batch % seq:
        raise PlanError(f"{where}: batch_tokens ({batch:,}) must be a multiple of seq_length ({seq:,}); "
                        f"e.g. {max(1, batch // seq) * seq:,}")
    if tokens < batch:
        raise PlanError(f"{where}: tokens ({tokens:,}) is less than one step of batch_tokens ({batch:,})")
    default = "fresh" if index == 0 else plan.optimizer_state
    state = _optimizer_state(raw.get("optimizer_state", default), where)
    if index == 0 and state == "carry":
        raise PlanError(f"{where}: the first stage has no previous stage to carry optimizer state from; "
                        "set optimizer_state: fresh")
    overrides = _dotted(raw.get("overrides") or {}, f"{where}: overrides")
    _check_owned(overrides, f"{where}: overrides")
    stage = Stage(name=name, config_path=str(config), seq_length=seq, tokens=tokens, batch_tokens=batch,
                  optimizer_state=state, overrides=overrides, directory=plan.run_dir / name)
    stage.global_batch_size = batch // seq
    stage.train_iters = math.ceil(tokens / batch)
    return stage


def runner_overrides(stage: Stage, start_from: Optional[str]) -> List[str]:
    """The keys the runner owns for `stage`, which starts from the weights in `start_from`."""
    return [f"data.seq_length={stage.seq_length}", f"train.global_batch_size={stage.global_batch_size}",
            f"train.train_iters={stage.train_iters}", f"checkpoint.save={json.dumps(stage.checkpoints)}",
            "checkpoint.load=null", f"checkpoint.pretrained={json.dumps(start_from)}",
            f"checkpoint.pretrained_optimizer={json.dumps(stage.optimizer_state == 'carry')}",
            f"logging.run_dir={json.dumps(str(stage.directory))}"]


def _stage_config(plan: Plan, stage: Stage, overrides: List[str]) -> GLM5Config:
    start_from = plan.stages[-1].checkpoints if plan.stages else plan.pretrained
    try:
        return load_config(stage.config_path, overrides + runner_overrides(stage, start_from))
    except ConfigError as err:
        raise PlanError(f"plan {plan.path}, stage {stage.name} ({stage.config_path}): {err}") from None


def _check_transitions(plan: Plan) -> None:
    for previous, stage in zip(plan.stages, plan.stages[1:]):
        where = f"plan {plan.path}, stage {stage.name}"
        a, b = previous.cfg.model, stage.cfg.model
        for key in ARCHITECTURE_KEYS:
            if getattr(a, key) != getattr(b, key):
                raise PlanError(f"{where}: model.{key} changes from {getattr(a, key)!r} to {getattr(b, key)!r}; "
                                "each stage starts from the previous stage's weights, so the architecture must stay")
        if a.experimental_attention_variant == "dsa" and b.experimental_attention_variant != "dsa":
            raise PlanError(f"{where}: model.experimental_attention_variant drops 'dsa' after stage {previous.name}; "
                            "the previous stage's indexer weights would have nowhere to go")
        if stage.optimizer_state != "carry":
            continue
        for section, key in (("optimizer", "optimizer"), ("train", "trainable_params")):
            old, new = getattr(getattr(previous.cfg, section), key), getattr(getattr(stage.cfg, section), key)
            if old != new:
                raise PlanError(f"{where}: optimizer_state carry needs the same {section}.{key} as stage "
                                f"{previous.name} ({old!r} -> {new!r}); set optimizer_state: fresh on this stage")
        if a.experimental_attention_variant != b.experimental_attention_variant:
            raise PlanError(f"{where}: optimizer_state carry cannot add DSA indexer weights (they have no optimizer "
                            "state); set optimizer_state: fresh on this stage")
