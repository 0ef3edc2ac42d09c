"""Ceiling terms per tier and machine size, container and device caps, the abort cap, config."""

from __future__ import annotations

import dataclasses

import pytest

from memory.ceiling import compute_limits, limit_terms
from memory.config import AbortOrder, MemoryConfig, load_memory_config
from memory.levels import GIB, MIB, Tier, static_reserve_bytes
from tests.support.memory_fakes import readings


def g(x: float) -> int:
    return int(x * GIB)


# -- static term -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "tier", "static"),
    [
        (16, Tier.SAFE, 12),  # < 24 GiB: 4 GiB for every tier
        (16, Tier.BALANCED, 12),
        (16, Tier.AGGRESSIVE, 12),
        (23.5, Tier.BALANCED, 19.5),
        (24, Tier.SAFE, 16),  # >= 24 GiB: 8 / 6 / 4
        (24, Tier.BALANCED, 18),
        (24, Tier.AGGRESSIVE, 20),
        (64, Tier.SAFE, 56),
        (64, Tier.BALANCED, 58),
        (64, Tier.AGGRESSIVE, 60),
        (128, Tier.BALANCED, 122),
    ],
)
def test_static_term_by_tier_and_system_size(total, tier, static):
    terms = limit_terms(readings(1, total_gib=total), MemoryConfig(tier=tier))
    assert terms["static"] == g(static)


def test_custom_tier_reserves_two_gib_on_any_machine_and_has_no_dynamic_term():
    for total, static in [(16, 14), (64, 62)]:
        cfg = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=100)
        terms = limit_terms(readings(1, total_gib=total, available_gib=1), cfg)
        assert terms == {"static": g(static), "custom": g(100)}
    limits = compute_limits(
        readings(1, total_gib=64), MemoryConfig.from_mapping({"custom_ceiling_gib": 20})
    )
    assert (limits.ceiling_bytes, limits.binding_term, limits.tier) == (
        g(20),
        "custom",
        Tier.CUSTOM,
    )
    assert (limits.soft_bytes, limits.hard_bytes) == (g(17), g(19))


def test_tiny_machines_keep_half_their_ram():
    assert static_reserve_bytes(Tier.SAFE, g(4)) == g(2)
    assert limit_terms(readings(0.1, total_gib=4), MemoryConfig())["static"] == g(2)


# -- dynamic term -------------------------------------------------------------------------


def test_dynamic_term_on_linux_is_own_footprint_plus_available():
    r = readings(10, total_gib=64, available_gib=20, active_gib=12, footprint_gib=9)
    limits = compute_limits(r, MemoryConfig(tier=Tier.BALANCED))
    assert limits.terms["dynamic"] == g(29)  # footprint 9 + available 20 (not active)
    assert (limits.ceiling_bytes, limits.binding_term) == (g(29), "dynamic")


@pytest.mark.parametrize(
    ("tier", "dynamic"), [(Tier.SAFE, 15.8), (Tier.BALANCED, 17.0), (Tier.AGGRESSIVE, 18.2)]
)
def test_dynamic_term_with_vm_statistics_counts_a_tier_share_of_active_pages(tier, dynamic):
    r = dataclasses.replace(
        readings(10, total_gib=64),
        system_free_bytes=g(2),
        system_inactive_bytes=g(3),
        system_active_bytes=g(4),
    )
    assert limit_terms(r, MemoryConfig(tier=tier))["dynamic"] == pytest.approx(g(dynamic), abs=2)


def test_dynamic_term_is_skipped_when_the_system_figure_is_unavailable():
    r = dataclasses.replace(readings(10, total_gib=64), system_available_bytes=None)
    assert "dynamic" not in limit_terms(r, MemoryConfig())


def test_the_ceiling_moves_with_availability_and_the_abort_cap_does_not():
    cfg = MemoryConfig(tier=Tier.BALANCED)
    tight = compute_limits(readings(10, total_gib=64, available_gib=20), cfg)
    loose = compute_limits(readings(10, total_gib=64, available_gib=40), cfg)
    assert (tight.ceiling_bytes, loose.ceiling_bytes) == (g(30), g(50))
    assert tight.abort_cap_bytes == loose.abort_cap_bytes == g(58)
    assert tight.abort_binding_term == "static"


# -- container, device, operator ------------------------------------------------------------


def test_container_limit_binds_with_a_tenth_reserve_on_small_limits():
    limits = compute_limits(readings(1, total_gib=64, container_limit_gib=8), MemoryConfig())
    assert limits.terms["container"] == g(8) - int(g(8) * 0.10)
    assert limits.binding_term == "container"
    assert limits.abort_cap_bytes == limits.ceiling_bytes  # stable: in the abort cap too


def test_a_two_gib_container_still_leaves_a_usable_ceiling():
    limits = compute_limits(readings(0.5, total_gib=23.5, container_limit_gib=2), MemoryConfig())
    assert limits.ceiling_bytes == g(2) - int(g(2) * 0.10)  # ~1.8 GiB
    assert limits.soft_bytes == int(limits.ceiling_bytes * 0.90)
    tiny = compute_limits(readings(0.1, total_gib=23.5, container_limit_gib=0.25), MemoryConfig())
    assert tiny.ceiling_bytes == 256 * MIB - 64 * MIB  # reserve floor of 64 MiB


def test_large_container_limits_keep_at_most_the_tier_reserve():
    limits = compute_limits(readings(1, total_gib=256, container_limit_gib=128), MemoryConfig())
    assert limits.terms["container"] == g(122)  # min(6 GiB, 12.8 GiB)


def test_device_cap_and_operator_cap_bind():
    device = compute_limits(readings(1, total_gib=64, device_gib=40), MemoryConfig())
    assert (device.ceiling_bytes, device.binding_term) == (g(40), "device")
    assert device.abort_cap_bytes == g(40)
    operator = compute_limits(readings(1, total_gib=64), MemoryConfig(operator_cap_bytes=g(10)))
    assert (operator.ceiling_bytes, operator.binding_term) == (g(10), "operator")


def test_soft_and_hard_fraction_overrides():
    cfg = MemoryConfig(tier=Tier.SAFE, soft_fraction=0.5, hard_fraction=0.75)
    limits = compute_limits(readings(1, total_gib=64, available_gib=100), cfg)
    assert limits.ceiling_bytes == g(56)
    assert (limits.soft_bytes, limits.hard_bytes) == (g(28), g(42))


@pytest.mark.parametrize(
    ("tier", "soft"),
    [(Tier.SAFE, 0.85), (Tier.BALANCED, 0.90), (Tier.AGGRESSIVE, 0.925), (Tier.CUSTOM, 0.85)],
)
def test_soft_threshold_by_tier_and_hard_095(tier, soft):
    cfg = MemoryConfig(tier=tier, custom_ceiling_gib=40 if tier is Tier.CUSTOM else None)
    limits = compute_limits(readings(1, total_gib=64, available_gib=200, device_gib=40), cfg)
    assert limits.ceiling_bytes == g(40)
    assert limits.soft_bytes == int(g(40) * soft)
    assert limits.hard_bytes == int(g(40) * 0.95)


def test_a_container_smaller_than_its_reserve_floors_at_one_byte():
    r = dataclasses.replace(readings(0, total_gib=64), container_limit_bytes=1024)
    assert compute_limits(r, MemoryConfig()).ceiling_bytes == 1


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tier": Tier.CUSTOM}, "tier 'custom' needs custom_ceiling_gib > 0"),
        ({"tier": Tier.CUSTOM, "custom_ceiling_gib": 0}, "custom_ceiling_gib > 0"),
        ({"custom_ceiling_gib": 8}, "custom_ceiling_gib applies only to tier 'custom'"),
        ({"soft_fraction": 0.96}, "0 < soft_fraction < hard_fraction <= 1"),
        ({"hard_fraction": 1.2}, "hard_fraction=1.2"),
        ({"soft_fraction": 0.0}, "soft_fraction=0.0"),
        ({"active_poll_s": 0}, "active_poll_s must be > 0"),
        ({"empty_poll_s": -1}, "empty_poll_s must be > 0"),
        ({"resume_band_fraction": 0.5}, "resume_band_fraction must be in [0, 0.2]"),
        ({"resume_band_fraction": -0.01}, "resume_band_fraction must be in [0, 0.2]"),
        ({"operator_cap_bytes": 0}, "operator_cap_bytes must be > 0"),
        ({"emergency_polls": 0}, "emergency_polls must be >= 1"),
        ({"reclaim_grace_polls": -1}, "reclaim_grace_polls must be >= 0"),
        ({"prefill_min_chunk_tokens": 0}, "prefill_min_chunk_tokens must be >= 1"),
        ({"prefill_max_chunk_tokens": 16}, "prefill_max_chunk_tokens must be >= prefill_min"),
    ],
)
def test_config_validation_names_the_bad_setting(changes, message):
    with pytest.raises(ValueError, match="invalid memory settings") as info:
        MemoryConfig(**changes).validate()
    assert message in str(info.value)


def test_config_validation_reports_every_error_at_once():
    with pytest.raises(ValueError) as info:
        MemoryConfig(active_poll_s=0, idle_poll_s=0).validate()
    assert "active_poll_s" in str(info.value) and "idle_poll_s" in str(info.value)


def test_from_mapping_accepts_dashes_aliases_and_infers_custom():
    cfg = MemoryConfig.from_mapping(
        {
            "custom-ceiling-gib": 12,
            "soft-fraction": 0.8,
            "operator_cap_gib": 10,
            "abort-order": "Youngest",
        }
    )
    assert cfg.tier is Tier.CUSTOM and cfg.custom_ceiling_gib == 12.0
    assert cfg.soft_fraction == 0.8 and cfg.operator_cap_bytes == g(10)
    assert cfg.abort_order is AbortOrder.YOUNGEST
    assert MemoryConfig.from_mapping({"tier": "SAFE"}).tier is Tier.SAFE
    assert MemoryConfig.from_mapping({}) == MemoryConfig()
    unset_flags = {"tier": None, "soft_fraction": None, "operator_cap_gib": None, "enabled": None}
    assert MemoryConfig.from_mapping(unset_flags) == MemoryConfig()


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"tier": "reckless"}, "tier must be one of 'safe', 'balanced', 'aggressive', 'custom'"),
        ({"enabled": "yes"}, "enabled must be true or false"),
        ({"soft_fraction": True}, "soft_fraction must be a number"),
        ({"soft_fraction": "0.8"}, "soft_fraction must be a number"),
        ({"emergency_polls": 2.5}, "emergency_polls must be an integer"),
        ({"abort_order": "oldest"}, "abort_order must be one of"),
    ],
)
def test_from_mapping_type_errors(mapping, message):
    with pytest.raises(ValueError, match=message):
        MemoryConfig.from_mapping(mapping)


def test_from_mapping_reports_unknown_keys_clearly():
    with pytest.raises(ValueError) as info:
        MemoryConfig.from_mapping({"tier": "safe", "sof_fraction": 0.8, "ceiling": 3})
    text = str(info.value)
    assert "unknown memory setting(s): ceiling, sof_fraction" in text
    assert "soft_fraction" in text.split("valid keys:")[1]


def test_load_memory_config_from_toml(tmp_path):
    table = tmp_path / "plimsoll.toml"
    table.write_text('[memory]\ntier = "aggressive"\nhard_fraction = 0.97\nidle_poll_s = 5\n')
    cfg = load_memory_config(table)
    assert (cfg.tier, cfg.hard_fraction, cfg.idle_poll_s) == (Tier.AGGRESSIVE, 0.97, 5.0)

    flat = tmp_path / "flat.toml"
    flat.write_text("custom_ceiling_gib = 6.5\nenabled = false\n")
    cfg = load_memory_config(flat)
    assert (cfg.tier, cfg.custom_ceiling_bytes, cfg.enabled) == (Tier.CUSTOM, int(6.5 * GIB), False)

    bad = tmp_path / "bad.toml"
    bad.write_text('[memory]\ntier = "safe"\nwhatever = 1\n')
    with pytest.raises(ValueError, match="unknown memory setting"):
        load_memory_config(bad)


def test_the_resume_band_is_opt_in_and_hysteresis_is_gone():
    assert MemoryConfig().resume_band_fraction == 0.0  # the seed: resume at ok
    assert MemoryConfig.from_mapping({"resume-band-fraction": 0.02}).resume_band_fraction == 0.02
    with pytest.raises(ValueError, match="unknown memory setting"):
        MemoryConfig.from_mapping({"hysteresis_fraction": 0.02})
