"""The `policy:` section of the sidecar's YAML: rules over each agent's figures, and the settings
pushed to every agent that connects. Parsed and validated here (errors name the field); the
engine that applies it is exporter.policy.engine.

    policy:
      dry_run: false
      initial_settings: "garbage_collection_threshold:0.8"
      rules:
        - name: fragmented
          metric: fragmentation_ratio
          above: 0.4          # fire level
          clear: 0.25         # hysteresis: the rule resets only below this
          for: 30s
          cooldown: 5m
          max_actions_per_hour: 4
          action: reclaim
          mode: gc            # gc | all
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from exporter.shared.config import ConfigError, Section, described, finite_number, setting, shown
from exporter.shared.settings import validate_settings

# What a rule can watch, per agent and CUDA device (exporter.policy.engine computes them).
METRICS: dict[str, str] = {
    "fragmentation_ratio": "(reserved - allocated) / reserved: the cache's unused share now, 0-1",
    "peak_fragmentation_ratio": "1 - peak allocated / peak reserved over the report interval, "
                                "0-1",
    "reserved_share": "reserved bytes / the GPU's total memory (NVML), 0-1",
    "reserved_bytes": "bytes reserved by the allocator",
    "retry_rate": "allocation retries per second, between two reports",
    "nvml_free_bytes": "the GPU's free memory (NVML total - used), bytes",
    "nvml_free_ratio": "the GPU's free memory / its total (NVML), 0-1",
    "pending_events": "stream events not yet completed (record_stream)",
}
ACTIONS = ("reclaim", "set_config")
RECLAIM_MODES = ("gc", "all")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_MAX_DURATION_CHARACTERS = 32


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    metric: str
    # "above": fires when the figure is above `fire`, clears below `clear`; "below": mirrored.
    direction: str
    fire: float
    clear: float
    for_seconds: float = 0.0
    cooldown_seconds: float = 300.0
    max_actions_per_hour: int = 6
    action: str = "reclaim"
    mode: str = "gc"          # reclaim: gc (down to the GC threshold) or all (empty_cache)
    settings: str = ""        # set_config

    def breached(self, value: float) -> bool:
        return value > self.fire if self.direction == "above" else value < self.fire

    def cleared(self, value: float) -> bool:
        return value < self.clear if self.direction == "above" else value > self.clear


def parse_duration(value: Any, path: str) -> float:
    """Seconds from a number or a string like '500ms', '30s', '5m', '1h'."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a duration like 30s or 5m, got {shown(value)}")
    if isinstance(value, (int, float)):
        seconds = finite_number(value, path)
    # Length first: the pattern backtracks quadratically on a long run of digits.
    elif (isinstance(value, str) and len(value) <= _MAX_DURATION_CHARACTERS
          and (match := _DURATION.match(value))):
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ConfigError(f"{path}: expected a duration like 30s, 5m or a number of seconds, "
                          f"got {shown(value)}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{path}: must be 0 or more seconds, got {shown(value)}")
    return seconds


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string, got {described(value)}")
    return value


def _settings(text: str, path: str) -> str:
    try:
        return validate_settings(text)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None


_RULE_KEYS = {"name", "metric", "above", "below", "clear", "for", "cooldown",
              "max_actions_per_hour", "action", "mode", "settings"}


def _parse_rule(raw: Any, path: str) -> Rule:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping (a rule), got {described(raw)}")
    for key in raw:
        if key not in _RULE_KEYS:
            raise ConfigError(f"{path}.{key}: unknown setting (known here: "
                              f"{', '.join(sorted(_RULE_KEYS))})")
    name = _string(raw.get("name"), f"{path}.name")
    if not _NAME.match(name):
        raise ConfigError(f"{path}.name: {shown(name)} must be 1-64 letters, digits, '_', '.', "
                          "'-'")
    metric = _string(raw.get("metric"), f"{path}.metric")
    if metric not in METRICS:
        raise ConfigError(f"{path}.metric: must be one of {', '.join(METRICS)}; "
                          f"got {shown(metric)}")
    if ("above" in raw) == ("below" in raw):
        raise ConfigError(f"{path}: give exactly one of above (fire when higher) or below "
                          "(fire when lower)")
    direction = "above" if "above" in raw else "below"
    fire = finite_number(raw[direction], f"{path}.{direction}")
    clear = finite_number(raw["clear"], f"{path}.clear") if "clear" in raw else fire
    if (direction == "above" and clear > fire) or (direction == "below" and clear < fire):
        side = "at or below" if direction == "above" else "at or above"
        raise ConfigError(f"{path}.clear: must be {side} the fire level {fire:g} "
                          f"(hysteresis), got {clear:g}")
    action = _string(raw.get("action", "reclaim"), f"{path}.action")
    if action not in ACTIONS:
        raise ConfigError(f"{path}.action: must be one of {', '.join(ACTIONS)}; "
                          f"got {shown(action)}")
    mode = _string(raw.get("mode", "gc"), f"{path}.mode")
    if mode not in RECLAIM_MODES:
        raise ConfigError(f"{path}.mode: must be one of {', '.join(RECLAIM_MODES)}; "
                          f"got {shown(mode)}")
    if action != "reclaim" and "mode" in raw:
        raise ConfigError(f"{path}.mode: only for action reclaim")
    settings = ""
    if action == "set_config":
        if "settings" not in raw:
            raise ConfigError(f"{path}.settings: required for action set_config")
        settings = _settings(_string(raw["settings"], f"{path}.settings"), f"{path}.settings")
    elif "settings" in raw:
        raise ConfigError(f"{path}.settings: only for action set_config")
    cap = raw.get("max_actions_per_hour", 6)
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= 3600:
        raise ConfigError(f"{path}.max_actions_per_hour: expected an integer from 1 to 3600, "
                          f"got {shown(cap)}")
    return Rule(
        name=name, metric=metric, direction=direction, fire=fire, clear=clear,
        for_seconds=parse_duration(raw.get("for", 0), f"{path}.for"),
        cooldown_seconds=parse_duration(raw.get("cooldown", 300), f"{path}.cooldown"),
        max_actions_per_hour=cap, action=action, mode=mode, settings=settings)


def _initial_settings(value: Any, path: str) -> str:
    text = _string(value or "", path)
    return _settings(text, path) if text else text


def _rules(value: Any, path: str) -> tuple[Rule, ...]:
    raw = value or []
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: expected a list of rules, got {described(raw)}")
    return tuple(_parse_rule(r, f"{path}[{i}]") for i, r in enumerate(raw))


@dataclasses.dataclass(frozen=True)
class PolicyConfig(Section):
    dry_run: bool = False
    # Settings string sent with set_config to every agent when it connects ("" = none).
    initial_settings: str = setting("", parse=_initial_settings)
    interval_seconds: float = setting(1.0, key="interval", parse=parse_duration, positive=True,
                                      maximum=3600)
    command_timeout_seconds: float = setting(30.0, key="command_timeout", parse=parse_duration,
                                             positive=True, maximum=3600)
    rules: tuple[Rule, ...] = setting((), parse=_rules)

    def validate(self, path: str) -> None:
        seen: set[str] = set()
        for i, rule in enumerate(self.rules):
            if rule.name in seen:
                raise ConfigError(f"{path}.rules[{i}].name: {shown(rule.name)} is used twice")
            seen.add(rule.name)
