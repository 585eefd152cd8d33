import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, settings

# experiments/gpu_check.sh runs the property tests on a GPU: every tensor and model a test makes goes there.
if os.environ.get("HYBRID_TEST_DEVICE"):
    torch.set_default_device(os.environ["HYBRID_TEST_DEVICE"])

# `--hypothesis-profile no-shrink` (experiments/gpu_check.sh): a failing example is reported as found, unshrunk.
settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])

sys.path.insert(0, str(Path(__file__).parent))  # tests import `strategies` directly

# What the suite measures of its tiny models (cost tables timed beside other tests, probe verdicts) stays out of the
# user's cache, where a real decode would read it (verifiers.embedded.measurements_dir); each test process gets its
# own folder.
os.environ["HYBRID_COSTS"] = tempfile.mkdtemp(prefix="hybrid-test-costs-")
atexit.register(shutil.rmtree, os.environ["HYBRID_COSTS"], ignore_errors=True)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test, restored after it: tiny models run fastest single-threaded, and the
    suite shares 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def served_logger(monkeypatch):
    """The glue's "hybrid.serving" logger, left as found afterwards: served (HYBRID_SERVED=1), the glue gives it a
    handler on the stderr of the moment and stops it propagating, which would hide later tests' lines."""
    from hybrid.custom_generate.generate import logger

    for name in ("handlers", "propagate", "level"):
        monkeypatch.setattr(logger, name, list(logger.handlers) if name == "handlers" else getattr(logger, name))
    return logger


def pytest_terminal_summary(terminalreporter):
    from hybrid.testing import GREEDY_CHECKS, NEAR_TIE_EPS, SAMPLE_EPS, SAMPLING_CHECKS

    if GREEDY_CHECKS["checked"]:
        terminalreporter.write_line(
            f"greedy losslessness: {GREEDY_CHECKS['checked']} comparisons with model.generate, near-tie "
            f"exception (top-2 gap < {NEAR_TIE_EPS}) needed {GREEDY_CHECKS['near_ties']} times"
        )
    if SAMPLING_CHECKS["checked"]:
        terminalreporter.write_line(
            f"seeded sampling: {SAMPLING_CHECKS['checked']} comparisons with model.generate, boundary-draw exception "
            f"(float32 distributions within {SAMPLE_EPS}, the replayed draw's race) needed "
            f"{SAMPLING_CHECKS['boundary_draws']} times"
        )
