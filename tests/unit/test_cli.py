import re
import subprocess
import sys


def test_info_reports_the_backends_horovod_was_built_with():
    result = subprocess.run([sys.executable, "-m", "hvdtrain.cli", "info"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Rows are "name<two or more spaces>value".
    rows = dict(re.match(r"^(.*?)\s{2,}(.*)$", line).groups() for line in result.stdout.splitlines())
    assert rows["horovod"] == "0.28.1"
    assert rows["horovod MPI"] == "yes"
    assert rows["horovod Gloo"] == "yes"
