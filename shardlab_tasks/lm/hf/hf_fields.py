"""config.json's fields read for what they must be: each value checked for its type and range before it is used, so
a wrong one is one line naming config.json and the field, never a traceback, a truncation (``head_dim=3.7`` read as
3) or a NaN carried into the model (``rms_norm_eps=NaN`` gave NaN logits).

``integer`` takes a JSON integer only (``3.7``, ``"64"`` and ``true`` are refused, not converted), ``number`` a finite
int or float, ``flag`` a JSON boolean, ``optional_*`` the same or null/absent. And before any module is built, the
shape is checked against a plan (``shape_refusal``): a config.json with two million layers built modules for minutes
on the meta device before anything said no.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shardlab.errors import ConfigError

MAX_LAYERS = 4096
"""The most layers a config.json may give: 32x the deepest published LLMs (Llama 3.1 405B: 126), far below where
building the modules on meta costs minutes (two million: over 60 s and 1.7 GB)."""

MAX_PARAMETERS = 10**13
"""The most parameters a config.json may plan (10 T: 25x Llama 3.1 405B); counted from its fields, nothing built."""

MAX_WIDTH = 2**24
"""The largest value of a config.json size field (hidden size, vocabulary, positions): 16 M, past 10 M contexts."""


class HFConfigError(ConfigError):
    """A config.json that shardlab's architectures cannot express (or cannot read)."""


_MISSING = object()


def _get(hf: dict, key: str, default: Any) -> Any:
    return hf.get(key, default) if default is not _MISSING else hf.get(key, _MISSING)


def _refuse(path: Path, key: str, value: Any, must: str) -> HFConfigError:
    shown = "absent" if value is _MISSING else f"{value!r}"[:80]
    return HFConfigError(f"{path}: {key}={shown} must be {must}")


def integer(hf: dict, key: str, path: Path, default: Any = _MISSING, minimum: int = 1) -> int:
    """``hf[key]`` as a JSON integer >= ``minimum`` and <= MAX_WIDTH (a float, a string or a bool refused)."""
    value = _get(hf, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_WIDTH:
        raise _refuse(path, key, value, f"an integer from {minimum} to {MAX_WIDTH}")
    return value


def optional_integer(hf: dict, key: str, path: Path, minimum: int = 1) -> int | None:
    """``integer``, or None where the field is absent or null."""
    return None if hf.get(key) is None else integer(hf, key, path, minimum=minimum)


def number(hf: dict, key: str, path: Path, default: Any = _MISSING, positive: bool = True) -> float:
    """``hf[key]`` as a finite number (> 0 where ``positive``), returned as a float."""
    value = _get(hf, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse(path, key, value, "a finite number" + (" > 0" if positive else ""))
    if positive and value <= 0:
        raise _refuse(path, key, value, "a finite number > 0")
    return float(value)


def flag(hf: dict, key: str, path: Path, default: bool) -> bool:
    """``hf[key]`` as a JSON boolean (``"false"`` or 0 refused: either would be read the wrong way), or ``default``."""
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _refuse(path, key, value, "true or false")
    return value


def mapping(hf: dict, key: str, path: Path) -> dict:
    """``hf[key]`` as a JSON object ({} where absent or null)."""
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(path, key, value, "an object")
    return dict(value)


def names(hf: dict, key: str, path: Path) -> list[str]:
    """``hf[key]`` as a list of strings ([] where absent or null)."""
    value = hf.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(path, key, value, "a list of names")
    return value


def shape_refusal(section: dict[str, Any], vocab_size: int) -> str | None:
    """Why a model section read from config.json is too large to plan (beyond MAX_LAYERS or MAX_PARAMETERS, counted
    from its fields before any module is built), or None."""
    layers, dim = section["num_layers"], section["dim"]
    if layers > MAX_LAYERS:
        return f"num_layers {layers} is more than the {MAX_LAYERS} shardlab plans"
    if section["arch"] == "gpt":
        per_layer = 12 * dim * dim
    else:
        head_dim = section.get("head_dim") or dim // section["num_heads"]
        attention = dim * head_dim * (2 * section["num_heads"] + 2 * section["num_kv_heads"])
        moe = section.get("moe")
        if moe:  # routed experts, the shared one and the router in place of the dense MLP
            experts = moe["num_experts"] * moe["ffn_dim"] + moe.get("shared_ffn_dim", 0)
            per_layer = attention + 3 * dim * experts + dim * moe["num_experts"]
        else:
            per_layer = attention + 3 * dim * section["ffn_dim"]
    total = layers * per_layer + 2 * vocab_size * dim
    if total > MAX_PARAMETERS:
        return f"its shape plans {total:.3g} parameters, more than the {MAX_PARAMETERS:.0e} shardlab plans"
    return None
