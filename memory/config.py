"""The memory settings: one dataclass, loadable from TOML, a mapping or CLI flags.

Keys are the `MemoryConfig` field names; CLI flags use the same names with
dashes (``--soft-fraction``). `from_mapping` accepts either spelling, reports
unknown keys by name, and validates the result.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory.levels import (
    ACTIVE_POLL_S,
    EMERGENCY_MARGIN_BYTES,
    EMERGENCY_POLLS,
    EMPTY_POLL_S,
    GIB,
    HARD_THRESHOLD,
    IDLE_POLL_S,
    POOL_RECLAIM_FLOOR_BYTES,
    PREFILL_MAX_CHUNK_TOKENS,
    PREFILL_MIN_CHUNK_TOKENS,
    PRESSURE_RECLAIM_GRACE_POLLS_MAX,
    Tier,
    soft_threshold,
)

MAX_RESUME_BAND_FRACTION = 0.2
# A just-loaded model is spared idle eviction this long: about one idle poll, so the
# tick right after a load cannot undo it (see memory.plans.eviction).
LOAD_WARMUP_S = 10.0


class AbortOrder(enum.StrEnum):
    """Which requests a non-emergency abort ends.

    ALL (default): the victim's requests are all aborted. YOUNGEST / LARGEST are graded relief: end requests one by one
    (youngest start time first, or largest byte estimate first) until the
    estimated bytes cover the deficit; an unknown estimate ends the batch so
    the next tick re-measures before ending more.
    """

    ALL = "all"
    YOUNGEST = "youngest"
    LARGEST = "largest"


@dataclass(frozen=True)
class ModelLimits:
    """How many models may be loaded, and how many bytes of them (None: no limit);
    enforced by memory.plans.model_limits."""

    max_loaded_models: int | None = None
    max_model_bytes: int | None = None


@dataclass(frozen=True)
class MemoryConfig:
    enabled: bool = True
    tier: Tier = Tier.BALANCED
    custom_ceiling_gib: float | None = None  # tier custom: the operator's ceiling
    soft_fraction: float | None = None  # None: the tier's default (0.85/0.90/0.925/0.85)
    hard_fraction: float | None = None  # None: 0.95
    operator_cap_bytes: int | None = None  # an extra cap on top of any tier
    active_poll_s: float = ACTIVE_POLL_S
    idle_poll_s: float = IDLE_POLL_S
    empty_poll_s: float = EMPTY_POLL_S
    # Opt-in: after pressure, admission resumes only once usage is
    # this share of the ceiling below the soft mark. The level itself is ok below soft.
    resume_band_fraction: float = 0.0
    abort_order: AbortOrder = AbortOrder.ALL
    pressure_reclaim: bool = True  # False: never ask engines to drain the pool, never defer
    pool_reclaim_floor_bytes: int = POOL_RECLAIM_FLOOR_BYTES
    reclaim_grace_polls: int = PRESSURE_RECLAIM_GRACE_POLLS_MAX
    emergency_margin_bytes: int = EMERGENCY_MARGIN_BYTES
    emergency_polls: int = EMERGENCY_POLLS
    prefill_min_chunk_tokens: int = PREFILL_MIN_CHUNK_TOKENS
    prefill_max_chunk_tokens: int = PREFILL_MAX_CHUNK_TOKENS
    load_warmup_s: float = LOAD_WARMUP_S  # 0: no warm-up
    # Loaded-model limits (memory.plans.model_limits); None: no limit.
    max_loaded_models: int | None = None
    max_model_bytes: int | None = None

    # -- derived ---------------------------------------------------------------
    @property
    def effective_soft_fraction(self) -> float:
        return self.soft_fraction if self.soft_fraction is not None else soft_threshold(self.tier)

    @property
    def effective_hard_fraction(self) -> float:
        return self.hard_fraction if self.hard_fraction is not None else HARD_THRESHOLD

    @property
    def model_limits(self) -> ModelLimits:
        return ModelLimits(self.max_loaded_models, self.max_model_bytes)

    @property
    def custom_ceiling_bytes(self) -> int | None:
        if self.custom_ceiling_gib is None:
            return None
        return int(self.custom_ceiling_gib * GIB)

    # -- validation --------------------------------------------------------------
    def validate(self) -> MemoryConfig:
        """Raise ValueError naming every bad setting; return self when all is well."""
        errors: list[str] = []
        if not isinstance(self.tier, Tier):
            errors.append(f"tier must be one of {_choices(Tier)}, got {self.tier!r}")
        if self.tier is Tier.CUSTOM and not (
            self.custom_ceiling_gib is not None and self.custom_ceiling_gib > 0
        ):
            errors.append("tier 'custom' needs custom_ceiling_gib > 0")
        if self.tier is not Tier.CUSTOM and self.custom_ceiling_gib is not None:
            errors.append(
                f"custom_ceiling_gib applies only to tier 'custom' (tier is '{self.tier}')"
            )
        if not isinstance(self.abort_order, AbortOrder):
            errors.append(
                f"abort_order must be one of {_choices(AbortOrder)}, got {self.abort_order!r}"
            )
        if isinstance(self.tier, Tier):
            soft, hard = self.effective_soft_fraction, self.effective_hard_fraction
            if not 0 < soft < hard <= 1:
                errors.append(
                    f"fractions must satisfy 0 < soft_fraction < hard_fraction <= 1 "
                    f"(soft_fraction={soft}, hard_fraction={hard})"
                )
        for name in ("active_poll_s", "idle_poll_s", "empty_poll_s"):
            if not getattr(self, name) > 0:
                errors.append(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.resume_band_fraction <= MAX_RESUME_BAND_FRACTION:
            errors.append(
                f"resume_band_fraction must be in [0, {MAX_RESUME_BAND_FRACTION}], "
                f"got {self.resume_band_fraction}"
            )
        if self.operator_cap_bytes is not None and self.operator_cap_bytes <= 0:
            errors.append(f"operator_cap_bytes must be > 0, got {self.operator_cap_bytes}")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            errors.append(f"max_loaded_models must be >= 1, got {self.max_loaded_models}")
        if self.max_model_bytes is not None and self.max_model_bytes <= 0:
            errors.append(f"max_model_bytes must be > 0, got {self.max_model_bytes}")
        if not 0 <= self.load_warmup_s < math.inf:
            errors.append(f"load_warmup_s must be finite and >= 0, got {self.load_warmup_s}")
        for name in ("pool_reclaim_floor_bytes", "reclaim_grace_polls", "emergency_margin_bytes"):
            if getattr(self, name) < 0:
                errors.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.emergency_polls < 1:
            errors.append(f"emergency_polls must be >= 1, got {self.emergency_polls}")
        if self.prefill_min_chunk_tokens < 1:
            errors.append(
                f"prefill_min_chunk_tokens must be >= 1, got {self.prefill_min_chunk_tokens}"
            )
        if self.prefill_max_chunk_tokens < self.prefill_min_chunk_tokens:
            errors.append(
                "prefill_max_chunk_tokens must be >= prefill_min_chunk_tokens "
                f"({self.prefill_max_chunk_tokens} < {self.prefill_min_chunk_tokens})"
            )
        if errors:
            raise ValueError("invalid memory settings: " + "; ".join(errors))
        return self

    # -- construction ------------------------------------------------------------
    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> MemoryConfig:
        """Build from TOML/CLI-style keys (dashes or underscores); validates.

        ``operator_cap_gib`` and ``max_model_memory_gib`` are accepted for
        ``operator_cap_bytes`` and ``max_model_bytes``.
        A None value means "not given" (an unset CLI flag) and keeps the default.
        Giving ``custom_ceiling_gib`` without ``tier`` selects tier custom.
        """
        values: dict[str, Any] = {}
        unknown: list[str] = []
        for raw_key, value in mapping.items():
            key = str(raw_key).replace("-", "_")
            if key not in _FIELDS and key not in _GIB_ALIASES:
                unknown.append(str(raw_key))
                continue
            if value is None:
                continue  # an unset CLI flag: keep the default
            if key in _GIB_ALIASES:
                values[_GIB_ALIASES[key]] = int(_number(key, value) * GIB)
                continue
            values[key] = value
        if unknown:
            raise ValueError(
                f"unknown memory setting(s): {', '.join(sorted(unknown))}; "
                f"valid keys: {', '.join(sorted([*_FIELDS, *_GIB_ALIASES]))}"
            )
        if "tier" not in values and values.get("custom_ceiling_gib") is not None:
            values["tier"] = Tier.CUSTOM
        return cls(**{k: _coerce(k, v) for k, v in values.items()}).validate()

    def replace(self, **changes: Any) -> MemoryConfig:
        return dataclasses.replace(self, **changes).validate()


def load_memory_config(path: str | Path) -> MemoryConfig:
    """Read a TOML file: keys at top level or under a ``[memory]`` table."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    section = data["memory"] if isinstance(data.get("memory"), dict) else data
    return MemoryConfig.from_mapping(section)


# ---------------------------------------------------------------------------

_FIELDS = {f.name: f for f in dataclasses.fields(MemoryConfig)}
_GIB_ALIASES = {"operator_cap_gib": "operator_cap_bytes", "max_model_memory_gib": "max_model_bytes"}
_BOOL_KEYS = {"enabled", "pressure_reclaim"}
_INT_KEYS = {
    "operator_cap_bytes",
    "pool_reclaim_floor_bytes",
    "reclaim_grace_polls",
    "emergency_margin_bytes",
    "emergency_polls",
    "prefill_min_chunk_tokens",
    "prefill_max_chunk_tokens",
    "max_loaded_models",
    "max_model_bytes",
}
_OPTIONAL_KEYS = {"custom_ceiling_gib", "soft_fraction", "hard_fraction", "operator_cap_bytes",
                  "max_loaded_models", "max_model_bytes"}


def _choices(enum_type: type[enum.Enum]) -> str:
    return ", ".join(repr(m.value) for m in enum_type)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def _coerce(key: str, value: Any) -> Any:
    if value is None and key in _OPTIONAL_KEYS:
        return None
    if key == "tier":
        try:
            return Tier(str(value).lower())
        except ValueError:
            raise ValueError(f"tier must be one of {_choices(Tier)}, got {value!r}") from None
    if key == "abort_order":
        try:
            return AbortOrder(str(value).lower())
        except ValueError:
            raise ValueError(
                f"abort_order must be one of {_choices(AbortOrder)}, got {value!r}"
            ) from None
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    return _number(key, value)
