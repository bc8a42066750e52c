import pytest

from tests import bounded_autotune


@pytest.fixture(scope="session", autouse=True)
def autotune_first_config_that_runs():
    """Every GPU test runs with Triton autotuning bounded (tests/bounded_autotune.py): on a
    fresh machine FLA's autotuning, not the tests, took most of the suite's time."""
    with pytest.MonkeyPatch.context() as patch:
        bounded_autotune.install(patch)
        yield
