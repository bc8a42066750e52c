"""tests/conftest.py's GPU hook: a bare `pytest` without CUDA deselects the gpu-marked tests and
says so in one line; `-m gpu` still runs them; `-m "not gpu"` (CI) is unchanged.

Each case runs pytest in-process (pytester) on a two-test directory whose conftest imports the
real hooks from tests.conftest.
"""

import pytest
import torch

pytest_plugins = ["pytester"]

DESELECTED_LINE = "1 GPU test deselected: no CUDA device (run them with -m gpu on a GPU machine)"


@pytest.fixture
def gpu_and_cpu_tests(pytester: pytest.Pytester) -> pytest.Pytester:
    """A directory with one gpu-marked and one unmarked test, and tests/conftest.py's hooks."""
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    pytester.makeconftest(
        "from tests.conftest import pytest_collection_modifyitems, pytest_report_collectionfinish"
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_on_gpu():
            pass

        def test_on_cpu():
            pass
        """
    )
    return pytester


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same answer on a GPU machine as on CI: no CUDA device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_m_the_gpu_test_is_deselected_and_said_so(gpu_and_cpu_tests, no_cuda):
    result = gpu_and_cpu_tests.runpytest()
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines([DESELECTED_LINE])
    assert result.stdout.str().count("GPU test deselected") == 1


def test_with_m_gpu_the_gpu_test_runs(gpu_and_cpu_tests, no_cuda):
    result = gpu_and_cpu_tests.runpytest("-m", "gpu", "-v")
    result.assert_outcomes(passed=1, deselected=1)  # test_on_cpu is the one -m gpu leaves out
    result.stdout.fnmatch_lines(["*test_on_gpu PASSED*"])
    result.stdout.no_fnmatch_line("*GPU test*deselected*")


def test_with_m_not_gpu_pytest_alone_deselects(gpu_and_cpu_tests, no_cuda):
    result = gpu_and_cpu_tests.runpytest("-m", "not gpu")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.no_fnmatch_line("*GPU test*deselected*")


def test_with_cuda_nothing_is_deselected(gpu_and_cpu_tests, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = gpu_and_cpu_tests.runpytest()
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*GPU test*deselected*")
