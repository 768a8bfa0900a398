import os

import pytest

# Set by libraries when first imported or used, not by tests: torch's compile cache and the
# pointer Inductor hands its compiled kernels (set again before every load: removing it is harmless),
# the OpenMP switches scikit-learn sets on import, and the address of W&B's service process, which
# its first run starts for the rest of the process (train.loggers=[wandb]).
_SET_BY_LIBRARIES = {"TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "KMP_DUPLICATE_LIB_OK",
                     "KMP_INIT_AT_FORK", "WANDB_SERVICE"}


@pytest.fixture(autouse=True)
def restore_environment():
    """A test that leaks an environment variable into the next one fails loudly instead."""
    saved = dict(os.environ)
    yield
    leaked = set(os.environ) - set(saved) - _SET_BY_LIBRARIES
    os.environ.clear()
    os.environ.update(saved)
    assert not leaked, f"test left environment variables behind: {sorted(leaked)}"
