"""Which decoder layers are MoE: `model.moe_layer_freq` -> a 0/1 list per layer.

megatron-core accepts an int N (layer i is MoE when i % N == 0) or a list; Megatron-LM also accepts a
string such as "[0]*3+[1]*75" and evaluates it with `eval`. We accept the same string but interpret it
ourselves over the AST, allowing only int / list-of-int literals, `+` and `*`, so a config file can never
run code.
"""

from __future__ import annotations

import ast
from typing import Any, List, Union

from pretrain.config.errors import ConfigError

# Large enough for any real model, small enough that "[0]*10**9"-style inputs cannot exhaust memory.
_MAX_VALUE = 1_000_000

_SYNTAX_HINT = 'use list literals of 0/1 joined by "+" and repeated with "*" by an int, e.g. "[0]*3+[1]*75"'


def parse_moe_layer_freq(value: Any, key: str = "model.moe_layer_freq") -> Union[int, List[int]]:
    """Normalize an int / list / Megatron-LM string to an int or a list of ints (not yet checked for 0/1)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an int, a list or a string, got bool {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{key} must be a list of ints (0 dense, 1 MoE), got {list(value)!r}")
        return list(value)
    if isinstance(value, str):
        try:
            tree = ast.parse(value.strip(), mode="eval")
        except SyntaxError as e:
            raise ConfigError(f"{key}: cannot parse {value!r} ({e.msg}); {_SYNTAX_HINT}") from None
        return _eval(tree.body, value, key)
    raise ConfigError(f"{key} must be an int, a list or a string, got {type(value).__name__} {value!r}")


def _eval(node: ast.AST, text: str, key: str) -> Union[int, List[int]]:
    """Evaluate the tiny expression language: int literals, lists of int literals, `+`, `*`."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value, text, key)
    if isinstance(node, ast.List):
        items = [_eval(elt, text, key) for elt in node.elts]
        if not all(isinstance(v, int) for v in items):
            raise ConfigError(f"{key}: nested lists are not allowed in {text!r}; {_SYNTAX_HINT}")
        return _bounded(items, text, key)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval(node.left, text, key), _eval(node.right, text, key)
        if isinstance(node.op, ast.Add):
            if type(left) is not type(right):
                raise ConfigError(f"{key}: cannot add a list and an int in {text!r}; {_SYNTAX_HINT}")
            return _bounded(left + right, text, key)
        if isinstance(left, list) and isinstance(right, list):
            raise ConfigError(f"{key}: cannot multiply two lists in {text!r}; {_SYNTAX_HINT}")
        # Check the size before building the list.
        size = (len(left) if isinstance(left, list) else left) * (len(right) if isinstance(right, list) else right)
        _bounded(size, text, key)
        return left * right
    raise ConfigError(f"{key}: unsupported expression {type(node).__name__} in {text!r}; {_SYNTAX_HINT}")


def _bounded(value: Union[int, List[int]], text: str, key: str) -> Union[int, List[int]]:
    size = len(value) if isinstance(value, list) else value
    if size > _MAX_VALUE:
        raise ConfigError(f"{key}: {text!r} is too large (more than {_MAX_VALUE} layers)")
    return value


def moe_layer_pattern(model_cfg: Any) -> List[int]:
    """Per decoder layer: 1 for an MoE FFN, 0 for a dense FFN (all 0 for a dense model)."""
    n = model_cfg.num_layers
    if model_cfg.num_moe_experts is None:
        return [0] * n
    freq = parse_moe_layer_freq(model_cfg.moe_layer_freq)
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(
                f"model.moe_layer_freq as an int means 'every N-th layer is MoE' and must be >= 1, "
                f"got {freq}; use 1 for all-MoE or a list / string like \"[0]*3+[1]*75\""
            )
        return [1 if i % freq == 0 else 0 for i in range(n)]  # megatron-core semantics
    if len(freq) != n:
        raise ConfigError(
            f"model.moe_layer_freq has {len(freq)} entries but model.num_layers is {n}; "
            f"give one 0/1 per layer, e.g. \"[0]*1+[1]*{max(n - 1, 0)}\""
        )
    bad = sorted({v for v in freq if v not in (0, 1)})
    if bad:
        raise ConfigError(f"model.moe_layer_freq entries must be 0 (dense) or 1 (MoE), found {bad}")
    return list(freq)
