"""The memory model never predicts out-of-memory for a configuration experts really trained (published-runs.md),
and the step-time predictions stay within the error budget (one set of defaults for every run)."""

import pytest

from bench.published_runs import RUNS, predict


@pytest.fixture(scope="module")
def predictions():
    return {r.id: predict(r) for r in RUNS}


@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_published_run_fits_in_80_gb(predictions, run):
    p = predictions[run.id]
    assert p.rejected is None, p.rejected
    assert p.peak_memory_bytes <= p.capacity_bytes


def test_mean_absolute_error_within_10_percent(predictions):
    errors = [abs(p.error) for p in predictions.values()]
    assert sum(errors) / len(errors) <= 0.10
    assert max(errors) <= 0.15
