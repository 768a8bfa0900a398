"""``hvdtrain doctor`` on this host: every check runs for real, the probe included."""
import re

from tests.launch.helpers import BIN, run


def test_doctor_passes_on_this_host_and_measures_an_allreduce(tmp_path):
    code, out, err = run([str(BIN / "hvdtrain"), "doctor", "-H", "localhost:2",
                          "--checkpoint-dir", str(tmp_path)], timeout=180)
    assert code == 0, out + err
    for check in ("reach", "versions", "network", "slots", "checkpoint dir", "clock vs checkpoint dir",
                  "checkpoint lock", "allreduce"):
        assert any(line.startswith(check) and " ok " in line for line in out.splitlines()), check
    assert "busbw" in out and "all 8 checks passed on 1 host(s)" in out


def test_doctor_warns_that_two_host_names_are_one_machine(tmp_path):
    """localhost and 127.0.0.1: one boot id, so one machine listed twice (a WARN, no FAIL)."""
    code, out, err = run([str(BIN / "hvdtrain"), "doctor", "-H", "localhost:1,127.0.0.1:1", "--no-probe",
                          "--checkpoint-dir", str(tmp_path)], timeout=120)
    assert code == 0, out + err
    assert re.search(r"host names\s+localhost \+ 127\.0\.0\.1\s+WARN\s+localhost, 127\.0\.0\.1 are one machine "
                     r"\(boot id [0-9a-f]{8}…\), listed 2 times", out), out


def test_doctor_fails_naming_the_row_when_the_checkpoint_dir_is_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, out, err = run([str(BIN / "hvdtrain"), "doctor", "-H", "localhost:1", "--no-probe",
                          "--checkpoint-dir", str(blocker / "ckpt")], timeout=120)
    assert code == 1
    assert "checkpoint dir (localhost)" in out and "not writable" in out
