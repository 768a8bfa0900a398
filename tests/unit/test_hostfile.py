from pathlib import Path

import pytest

from hvdtrain.launch.hostfile import (Host, HostfileError, parse_host_list, parse_hostfile, parse_hosts,
                                      to_colon_lines, to_host_list, to_openmpi)

HOSTFILES = Path(__file__).resolve().parents[2] / "hostfiles"


def test_every_format_with_comments_and_blank_lines():
    text = """
# a comment line
node001 slots=4 max_slots=8   # Open MPI
node002:2                     # Horovod / MPICH

node003                       # bare: one slot
node004 max-slots=3
"""
    assert parse_hosts(text, "hosts") == [
        Host("node001", 4, 8), Host("node002", 2), Host("node003", 1), Host("node004", 1, 3),
    ]


@pytest.mark.parametrize("name,hosts", [
    ("localhost", [Host("localhost", 2)]),
    ("openmpi.example", [Host("node001", 4), Host("node002", 4, 4)]),
    ("horovod.example", [Host("node001", 4), Host("node002", 4)]),
    ("bare.example", [Host("node001", 1), Host("node002", 1)]),
])
def test_the_shipped_examples_parse(name, hosts):
    assert parse_hostfile(HOSTFILES / name) == hosts


@pytest.mark.parametrize("text,message", [
    ("a slots=2\nb slots=0\n", "hf:2: bad slots '0'"),
    ("a slots=2\n\nb slots=-1\n", "hf:3: bad slots '-1'"),
    ("a:two\n", "hf:1: bad slot count 'two'"),
    ("a:1.5\n", "hf:1: bad slot count '1.5'"),
    ("a slots=2\n# c\na:3\n", "hf:3: host 'a' is listed again \\(first at line 1\\)"),
    ("a cpus=2\n", "hf:1: unknown setting 'cpus=2'"),
    ("a slots=4 max_slots=2\n", "hf:1: max_slots=2 is below slots=4"),
    ("a:2 extra\n", "hf:1: unexpected 'extra'"),
    ("$(reboot) slots=1\n", "hf:1: bad host name '\\$\\(reboot\\)'"),
    ("a;rm slots=1\n", "hf:1: bad host name 'a;rm'"),
    ("-oProxyCommand=x slots=1\n", "hf:1: bad host name '-oProxyCommand=x'"),
    ("# nothing\n\n", "hf: no hosts listed"),
])
def test_bad_lines_are_refused_naming_the_file_and_line(text, message):
    with pytest.raises(HostfileError, match=message):
        parse_hosts(text, "hf")


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(HostfileError, match="cannot read hostfile .*nope: No such file"):
        parse_hostfile(tmp_path / "nope")


def test_host_lists_parse_and_every_launcher_format_round_trips():
    hosts = parse_host_list("a:2,b:3,c")
    assert hosts == [Host("a", 2), Host("b", 3), Host("c", 1)]
    assert to_host_list(hosts) == "a:2,b:3,c:1"
    assert parse_hosts(to_openmpi(hosts), "x") == hosts
    assert parse_hosts(to_colon_lines(hosts), "x") == hosts
    assert to_openmpi([Host("n", 2, 4)]) == "n slots=2 max_slots=4\n"
