"""Fixtures of the model-family tests: `transformers`, the independent reference of the parity tests."""

import pytest

# Only the Python 3.11 environment (`make test`, the `parity` extra) has torch: its pinned
# CPU wheel exists only for 3.11, and elsewhere pip would fetch a multi-GB CUDA build.
WHY_SKIPPED = ("Hugging Face parity tests need torch and transformers (the `parity` extra), installed only in the "
               "Python 3.11 environment (`make test`): torch's pinned CPU wheel exists only for 3.11")


@pytest.fixture(scope="session")
def transformers():
    """The transformers module, with torch on one thread; skips the test (saying why) without the parity extra."""
    torch = pytest.importorskip("torch", reason=WHY_SKIPPED)
    module = pytest.importorskip("transformers", reason=WHY_SKIPPED)
    torch.set_num_threads(1)  # float32 CPU matmuls in one thread: deterministic and quick at these sizes
    return module
