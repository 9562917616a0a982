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


def test_rollout_settings_are_frozen():
    import dataclasses

    cfg = RolloutConfig(engine={"speculation": "off"}, kv_events=True)
    assert cfg.engine.speculation == "off" and cfg.engine.kv_events  # settled while building
    for name, value in (("temperature", 0.5), ("dispatch_kwargs", {}), ("engine", cfg.engine)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, name, value)
    other = dataclasses.replace(cfg, temperature=0.5)  # another object; the first is unchanged
    assert (other.temperature, cfg.temperature) == (0.5, 1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dispatch_kwargs={"bogus": 1}),
     r"/r\.yaml: RolloutConfig\.dispatch_kwargs: unknown option 'bogus' of dispatch policy 'war' "
     r"\(its options: kv_capacity_tokens, admission, thrash_bound, thrash_window, admission_order, defer_margin, cold_turns\)$"),
    (dict(dispatch_kwargs={"admission": "yes"}),
     r"/r\.yaml: RolloutConfig\.dispatch_kwargs: option 'admission' of dispatch policy 'war' must be bool, got 'yes'$"),
    (dict(dispatch_kwargs={"kv_capacity_tokens": [1024, "lots"]}),
     r"option 'kv_capacity_tokens' of dispatch policy 'war' must be null or int or a list of int"),
    (dict(dispatch_policy="sticky", dispatch_kwargs={"lru_capacity": -1}),
     r"/r\.yaml: RolloutConfig\.dispatch_kwargs: dispatch policy 'sticky': lru_capacity must be positive, got -1$"),
    (dict(dispatch_policy="verl_kv_aware", dispatch_kwargs={"load_weights": [0.5, 0.5]}),
     r"dispatch policy 'verl_kv_aware': load_weights must be 4 non-negative numbers"),
    (dict(dispatch_policy="round_robin", dispatch_kwargs={"admission": True}),
     r"unknown option 'admission' of dispatch policy 'round_robin' \(its options: none\)"),
])
def test_a_bad_dispatch_option_names_the_option_the_policy_and_the_file(tmp_path, kwargs, message):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(kwargs))
    with pytest.raises(ValueError, match=message):
        RolloutConfig.from_yaml(path)


def test_dispatch_options_are_typed():
    from war_openrlhf.dispatch.sticky import StickyOptions
    from war_openrlhf.dispatch.war import WarOptions

    assert RolloutConfig().dispatch_options == WarOptions()
    cfg = RolloutConfig(dispatch_policy="sticky", dispatch_kwargs={"lru_capacity": 5})
    assert cfg.dispatch_options == StickyOptions(lru_capacity=5)
