import io
import logging

import pytest

from hvdtrain.observability.progress import Progress, format_eta, resolve_mode


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_auto_draws_a_bar_only_on_a_terminal_and_only_on_rank_0():
    assert resolve_mode("auto", True, Terminal()) == "bar"
    assert resolve_mode("auto", True, io.StringIO()) == "log"  # a SLURM output file
    assert resolve_mode("auto", False, Terminal()) == "off"
    assert resolve_mode("bar", False, Terminal()) == "off"
    assert resolve_mode("log", True, Terminal()) == "log"


@pytest.mark.parametrize("seconds,text", [(0, "0:00"), (59.6, "1:00"), (61, "1:01"), (3725, "1:02:05"), (-3, "0:00")])
def test_eta_reads_as_a_clock(seconds, text):
    assert format_eta(seconds) == text


def capture_logger(name):
    stream = io.StringIO()
    logger = logging.getLogger(name)
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, stream


def test_log_mode_prints_one_plain_line_per_report_with_the_eta():
    logger, stream = capture_logger("test.progress.log")
    progress = Progress("log", total=100, initial=0, logger=logger)
    for _ in range(10):
        progress.advance()
    progress.report(epoch=1, step=10, loss=1.23456, lr=0.1, samples_per_sec=512.4, comm_fraction=0.25)
    progress.close()
    line = stream.getvalue()
    assert line.startswith("epoch 1 step 10/100 loss 1.2346 lr 0.1 512 samples/s, 25% waiting for gradients, ETA ")
    assert "\r" not in line and line.count("\n") == 1


def test_a_run_of_unknown_length_logs_its_steps_without_a_total_or_an_eta():
    """A stream without len() and no max_steps: the line cannot say "of how many" (it used to need
    max_steps only for this and the schedule)."""
    logger, stream = capture_logger("test.progress.unknown")
    progress = Progress("log", total=None, initial=0, logger=logger)
    progress.advance()
    progress.report(epoch=0, step=1, loss=1.0, lr=0.1, samples_per_sec=10.0, comm_fraction=0.0)
    progress.close()
    assert stream.getvalue() == "epoch 0 step 1 loss 1.0000 lr 0.1 10 samples/s, 0% waiting for gradients\n"


def test_bar_mode_draws_on_stderr_and_keeps_messages_whole(capsys):
    logger, stream = capture_logger("test.progress.bar")
    progress = Progress("bar", total=4, initial=1, logger=logger)
    for _ in range(3):
        progress.advance()
    progress.report(epoch=1, step=4, loss=0.5, lr=0.1, samples_per_sec=100.0, comm_fraction=0.1)
    progress.message("epoch 1/1 done")
    progress.close()
    err = capsys.readouterr().err
    assert "4/4" in err and "\r" in err and "loss=0.5000" in err
    assert stream.getvalue() == "epoch 1/1 done\n"


def test_off_mode_shows_nothing(capsys):
    logger, stream = capture_logger("test.progress.off")
    progress = Progress("off", total=4, initial=0, logger=logger)
    progress.advance()
    progress.report(epoch=1, step=1, loss=0.5, lr=0.1, samples_per_sec=100.0, comm_fraction=0.1)
    progress.close()
    assert stream.getvalue() == "" and capsys.readouterr().err == ""
