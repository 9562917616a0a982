"""check_number: the shared range check for float settings, and the configs that use it."""

import math

import pytest

from war_openrlhf.config_checks import check_number
from war_openrlhf.engine.spec_switch import SpecSwitchConfig
from war_openrlhf.rollout.config import RolloutConfig
from war_openrlhf.simulation.spec_replay import ReplayConfig


@pytest.mark.parametrize("value, bounds", [
    (0.5, dict(gt=0, le=1)),
    (1, dict(gt=0, le=1)),  # ints are numbers
    (1.0, dict(gt=0, le=1)),
    (0.0, dict(ge=0)),
    (0.0, dict(ge=0, lt=1)),
    (-5.0, dict(lt=0)),
    (2.0, dict(le=2)),
    (-1e300, {}),
])
def test_check_number_accepts_values_in_range(value, bounds):
    check_number("Owner", "field", value, **bounds)


@pytest.mark.parametrize("value, bounds, wording", [
    (0.0, dict(gt=0), "> 0"),
    (-0.1, dict(ge=0), ">= 0"),
    (1.0, dict(lt=1), "< 1"),
    (1.5, dict(le=1), "<= 1"),
    (0.0, dict(gt=0, le=1), r"in \(0, 1\]"),
    (1.0001, dict(gt=0, le=1), r"in \(0, 1\]"),
    (1.0, dict(ge=0, lt=1), r"in \[0, 1\)"),
])
def test_check_number_refuses_boundaries(value, bounds, wording):
    with pytest.raises(ValueError, match=rf"^Owner\.field: must be a finite number {wording}, got "):
        check_number("Owner", "field", value, **bounds)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, False, "1.0", None])
def test_check_number_refuses_nan_inf_bools_and_non_numbers(value):
    with pytest.raises(ValueError, match=r"^Owner\.field: must be a finite number, got "):
        check_number("Owner", "field", value)


def test_check_number_refuses_nan_even_without_bounds_that_would_catch_it():
    # NaN compares False with everything; a bare ``value < 0`` check lets it through.
    with pytest.raises(ValueError, match="nan"):
        check_number("Owner", "field", math.nan, ge=0)


@pytest.mark.parametrize("make, name", [
    (lambda: SpecSwitchConfig(ewma=math.nan), "SpecSwitchConfig.ewma"),
    (lambda: SpecSwitchConfig(threshold=math.inf), "SpecSwitchConfig.threshold"),
    (lambda: SpecSwitchConfig(hysteresis=math.nan), "SpecSwitchConfig.hysteresis"),
    (lambda: ReplayConfig(tool_delay_ticks_per_env_token=math.nan), "ReplayConfig.tool_delay_ticks_per_env_token"),
    (lambda: ReplayConfig(tool_delay_ticks=-1), "ReplayConfig.tool_delay_ticks"),
    (lambda: RolloutConfig(top_p=math.nan), "RolloutConfig.top_p"),
    (lambda: RolloutConfig(temperature=math.nan), "RolloutConfig.temperature"),
    (lambda: RolloutConfig(tool_timeout_s=math.inf), "RolloutConfig.tool_timeout_s"),
    (lambda: RolloutConfig(stats_interval_s=math.nan), "RolloutConfig.stats_interval_s"),
])
def test_configs_refuse_nan_and_inf_naming_the_field(make, name):
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        make()


def test_hysteresis_must_stay_below_threshold():
    with pytest.raises(ValueError, match=r"SpecSwitchConfig\.hysteresis: must be below threshold \(1\.0\)"):
        SpecSwitchConfig(threshold=1.0, hysteresis=1.0)
    SpecSwitchConfig(threshold=1.0, hysteresis=0.0)  # the lower bound is inclusive
