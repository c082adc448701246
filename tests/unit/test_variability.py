"""The variability model (issue 14): fitted from calibration's residuals, stored in the latency table."""

import copy
import json
from dataclasses import replace

import numpy as np
import pytest

from pipetune.config import load_hardware, load_model_config
from pipetune.cost import LatencyTableError, analytical_table
from pipetune.calibrate.action_fit import UNKNOWNS, Design, calibrate_design
from pipetune.cost.latency_table import table_from_dict
from pipetune.cost.variability import Spread, Variability

NOISY = Variability(stage=Spread(log_var=0.01, log_var_s=2e-4, min_s=1e-3), encoder=Spread(log_var=0.02),
                    p2p=Spread(log_var=0.05))


def test_variability_fit_recovers_a_known_spread():
    """Stage (forward + backward) and encoder timings of 1-50 ms, each the prediction times
    mean-one lognormal noise of log-variance 0.004 + 1e-4 s / d: calibration's fit recovers that
    variance within 15 % over the range (3,000 stage and 1,000 encoder observations)."""
    rng = np.random.default_rng(6)
    truth = Spread(log_var=0.004, log_var_s=1e-4, min_s=1e-3)
    n, n_enc = 3000, 1000
    X = np.zeros((n + n_enc, len(UNKNOWNS)))
    X[:n, UNKNOWNS.index("rest")] = np.exp(rng.uniform(np.log(1e-3), np.log(5e-2), n))
    X[:n, UNKNOWNS.index("fwd_s")] = X[:n, UNKNOWNS.index("bwd_s")] = 1
    X[n:, UNKNOWNS.index("encoder")] = np.exp(rng.uniform(np.log(1e-3), np.log(5e-2), n_enc))
    d = X.sum(axis=1) - np.where(np.arange(n + n_enc) < n, 2, 0)  # table has no overhead: predicted = the curve part
    v = truth.variance(d)
    y = d * np.exp(np.sqrt(v) * rng.standard_normal(len(d)) - v / 2)
    table = analytical_table(load_model_config("tiny"), load_hardware("h100"))
    fitted, _ = calibrate_design(table, Design(X, y))
    grid = np.array([1.5e-3, 5e-3, 2e-2, 4.5e-2])
    for spread in (fitted.variability.stage, fitted.variability.encoder):
        np.testing.assert_allclose(spread.variance(grid), truth.variance(grid), rtol=0.15)
    assert fitted.variability.p2p == Spread()  # messages are not observed
    few, _ = calibrate_design(replace(table, variability=NOISY), Design(X[:5], y[:5]))
    assert few.variability == NOISY  # too few observations: the previous spread stays


def tiny_table(**kw):
    return analytical_table(load_model_config("tiny"), load_hardware("h100"), **kw)


def test_table_round_trip_with_and_without_variability():
    plain = tiny_table()
    raw = plain.to_dict()
    assert "variability" not in raw and table_from_dict(raw).variability is None  # old tables load as before
    noisy = replace(plain, variability=NOISY)
    back = table_from_dict(json.loads(json.dumps(noisy.to_dict())))
    assert back.variability == NOISY and back.to_dict() == noisy.to_dict()
    partial = copy.deepcopy(raw)
    partial["variability"] = {"encoder": {"log_var": 0.01}}
    assert table_from_dict(partial).variability == Variability(encoder=Spread(log_var=0.01))


@pytest.mark.parametrize("value,message", [
    ([], "field 'variability' must be a JSON object"),
    ({"stages": {}}, r"variability has unknown action kinds \['stages'\]"),
    ({"stage": 0.1}, "variability.stage must be an object of log_var, log_var_s and min_s"),
    ({"stage": {"log_var": 0.1, "sigma": 1}}, "variability.stage must be an object"),
    ({"stage": {"log_var": -0.1}}, r"variability.stage.log_var must be a finite number >= 0, got -0.1"),
    ({"encoder": {"log_var_s": "1e-3", "min_s": 1e-3}}, "variability.encoder.log_var_s must be a finite number"),
    ({"p2p": {"log_var": True}}, "variability.p2p.log_var must be a finite number"),
    ({"stage": {"log_var_s": 1e-3}}, "variability.stage.min_s must be > 0 when log_var_s > 0"),
])
def test_malformed_variability_is_refused_naming_the_field(value, message):
    raw = tiny_table().to_dict()
    raw["variability"] = value
    with pytest.raises(LatencyTableError, match=message):
        table_from_dict(raw, where="t.json")
