"""The public API is what ``hvdtrain/__init__.py`` exports: every name resolves, and importing the
package costs nothing until a name is used (login nodes, ``hvdtrain --help``)."""
import subprocess
import sys

import hvdtrain


def test_every_exported_name_resolves():
    missing = [name for name in hvdtrain.__all__ if name != "__version__" and getattr(hvdtrain, name, None) is None]
    assert not missing, missing
    assert {"init", "World", "Trainer", "TrainConfig", "ModelPlan", "parse_job"} <= set(hvdtrain.__all__)


def test_importing_the_package_imports_neither_torch_nor_horovod():
    code = "import sys, hvdtrain; bad = [m for m in ('torch', 'horovod') if m in sys.modules]; sys.exit(str(bad) if bad else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
