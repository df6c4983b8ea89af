"""config.json read and checked (KimiConfig), and the errors the whole package raises."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..contract import DEFAULT_ACT_BITS, ExactnessError, check_act_bits


class KimiCheckpointError(ExactnessError, ValueError):
    """A checkpoint that is not what Kimi's native int4 format promises; names file and tensor."""


class KimiConversionError(ExactnessError, ValueError):
    """A model that convert_kimi_to_exact cannot convert faithfully; names the module."""


def brief(value) -> str:
    """repr(value) cut to a short single line, for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shown_key(name: str) -> str:
    """A JSON key for a message: as it is, or quoted where it would break the line."""
    return name if name.isprintable() else repr(name)


def json_kind(value) -> str:
    if value is None:
        return "null or nothing"
    return {bool: "a bool", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def json_object(value, where: str) -> dict:
    """value, which must be a JSON object."""
    if not isinstance(value, dict):
        raise KimiCheckpointError(f"{where}: expected a JSON object, got {json_kind(value)}")
    return value


def read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except OSError as e:
        raise KimiCheckpointError(f"{path}: unreadable ({e})") from e
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, nesting too deep
        raise KimiCheckpointError(f"{path}: not valid JSON ({e})") from e


@dataclass
class KimiConfig:
    hidden_size: int = 7168
    moe_intermediate_size: int = 2048
    intermediate_size: int = 18432
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    num_hidden_layers: int = 61
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    use_exact_generators: bool = True
    exact_act_bits: int = DEFAULT_ACT_BITS

    @classmethod
    def from_json(cls, config: dict, where: str = "config.json") -> KimiConfig:
        """The fields of a config.json (K2.5: of its text_config) that this class knows, each
        type-checked; the routed experts' two sizes must be there."""
        text, at = json_object(config, where), ""
        if "text_config" in config:  # K2.5 nests the language model's config
            text, at = json_object(config["text_config"], f"{where}: text_config"), "text_config."
        known = {}
        for name, f in cls.__dataclass_fields__.items():
            if name not in text:
                if name in ("hidden_size", "moe_intermediate_size"):
                    raise KimiCheckpointError(f"{where}: {at}{name}: missing")
                continue
            known[name] = config_value(name, text[name], type(f.default), f"{where}: {at}{name}")
        return cls(**known)


def config_value(name: str, value, kind: type, where: str):
    """One config.json field, checked against the type of its KimiConfig default."""
    if kind is bool:
        ok, what = isinstance(value, bool), "a bool"
    elif kind is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok, what = number and math.isfinite(value), "a finite number"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        what = "an int >= 0"
    if not ok:
        raise KimiCheckpointError(f"{where}: expected {what}, got {brief(value)}")
    if name in ("hidden_size", "moe_intermediate_size") and (value == 0 or value % 32):
        raise KimiCheckpointError(f"{where}: {value} is not a multiple of 32 (the int4 group)")
    if name == "exact_act_bits":
        try:
            check_act_bits(value)
        except ExactnessError as e:
            raise KimiCheckpointError(f"{where}: {e}") from e
    return value
