import shlex

import pytest

from hvdtrain.cli import main as cli_main
from hvdtrain.launch.commands import (LaunchSpec, horovodrun_argv, mpich_argv, openmpi_argv,
                                      srun_argv)
from hvdtrain.launch.hostfile import Host, HostfileError

TWO_HOSTS = (Host("hostA", 2), Host("hostB", 2))
COMMAND = ("python", "train.py", "--epochs", "3")


def spec(**overrides):
    values = dict(np=4, command=COMMAND, hosts=TWO_HOSTS, network_interface="eth0",
                  exports=("PATH", "PYTHONPATH"), as_root=False)
    values.update(overrides)
    return LaunchSpec(**values)


def test_open_mpi_command_line():
    assert openmpi_argv(spec()) == [
        "mpirun", "-np", "4", "-H", "hostA:2,hostB:2",
        "-mca", "plm_rsh_args", "-o ConnectTimeout=30 -o BatchMode=yes", "-bind-to", "none", "-map-by", "slot",
        "-mca", "pml", "ob1", "-mca", "btl", "^openib",
        "-mca", "btl_tcp_if_include", "eth0", "-mca", "oob_tcp_if_include", "eth0",
        "-x", "NCCL_SOCKET_IFNAME=eth0", "-x", "PATH", "-x", "PYTHONPATH",
        "python", "train.py", "--epochs", "3",
    ]


def test_open_mpi_on_one_host_as_root():
    assert openmpi_argv(spec(np=2, hosts=(), network_interface=None, exports=(), as_root=True)) == [
        "mpirun", "-np", "2", "--allow-run-as-root", "-bind-to", "none", "-map-by", "slot",
        "-mca", "pml", "ob1", "-mca", "btl", "^openib", "python", "train.py", "--epochs", "3",
    ]


def test_mpich_command_line():
    assert mpich_argv(spec()) == [
        "mpiexec", "-n", "4", "-hosts", "hostA:2,hostB:2", "-iface", "eth0",
        "-genv", "NCCL_SOCKET_IFNAME", "eth0", "-genvlist", "PATH,PYTHONPATH",
        "python", "train.py", "--epochs", "3",
    ]


def test_horovodrun_and_srun_command_lines():
    assert horovodrun_argv(spec()) == [
        "horovodrun", "-np", "4", "--start-timeout", "30", "-H", "hostA:2,hostB:2",
        "--network-interface", "eth0", "python", "train.py", "--epochs", "3",
    ]
    assert srun_argv(spec()) == [
        "srun", "--mpi=pmix", "--kill-on-bad-exit=1", "--ntasks=4", "--nodelist=hostA,hostB",
        "--export=ALL,NCCL_SOCKET_IFNAME=eth0", "python", "train.py", "--epochs", "3",
    ]


@pytest.mark.parametrize("overrides,error,message", [
    ({"np": 5}, HostfileError, "-np 5 asks for more ranks than the 4 slots of hostA:2,hostB:2"),
    ({"np": 0}, ValueError, "-np must be >= 1"),
    ({"command": ()}, ValueError, "no command to launch"),
    ({"network_interface": "eth0;reboot"}, HostfileError, "bad host name 'eth0;reboot'"),
    ({"start_timeout": 0}, ValueError, "--start-timeout must be >= 1 second"),
])
def test_impossible_launches_are_refused(overrides, error, message):
    with pytest.raises(error, match=message):
        spec(**overrides)


def test_cli_dry_run_prints_the_command_and_np_defaults_to_the_slots(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nhostA slots=2\nhostB:2\n")
    code = cli_main(["launch", "--hostfile", str(hostfile), "--launcher", "horovodrun", "--dry-run",
                     "--start-timeout", "90", "--", "python", "train.py", "--lr", "0.1"])
    assert code == 0
    assert shlex.split(capsys.readouterr().out) == [
        "horovodrun", "-np", "4", "--start-timeout", "90", "-H", "hostA:2,hostB:2",
        "python", "train.py", "--lr", "0.1",
    ]


def test_cli_reports_a_bad_hostfile_line_and_exits_2(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("hostA slots=2\nhostB slots=two\n")
    assert cli_main(["launch", "--hostfile", str(hostfile), "--dry-run", "--", "python"]) == 2
    assert f"{hostfile}:2: bad slots 'two'" in capsys.readouterr().err


def test_hosts_of_a_slurm_allocation_in_every_format(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02],gpu7")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2),4")
    outputs = {}
    for form in ("list", "openmpi", "colon", "np"):
        assert cli_main(["hosts", "--format", form]) == 0
        outputs[form] = capsys.readouterr().out
    assert outputs == {
        "list": "node01:2,node02:2,gpu7:4\n",
        "openmpi": "node01 slots=2\nnode02 slots=2\ngpu7 slots=4\n",
        "colon": "node01:2\nnode02:2\ngpu7:4\n",
        "np": "8\n",
    }


def test_hosts_outside_an_allocation_or_with_inconsistent_variables_fail(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    assert cli_main(["hosts"]) == 2
    assert "not inside a SLURM allocation" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-03]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    assert cli_main(["hosts"]) == 2
    assert "names 3 nodes but SLURM_TASKS_PER_NODE='2(x2)' covers 2" in capsys.readouterr().err


def test_ranks_map_to_hosts_slot_by_slot():
    from hvdtrain.launch.failures import rank_host
    hosts = (Host("a", 2), Host("b", 3))
    assert [rank_host(r, hosts, "here") for r in range(6)] == ["a", "a", "b", "b", "b", "here"]


@pytest.mark.parametrize("output,expected", [
    ("...\n  Process name: [[31763,1],3]\n  Exit code:    1\n", (3, None)),
    ("[1]<stderr>:boom\nProcess 1 exit with status code 255.\nProcess 0 exit with status code 1.\n", (1, None)),
    ("srun: error: node07: task 5: Exited with exit code 2\n", (5, "node07")),
    ("The first process to do so was:\nProcess name: 1\nExit code: 75\n", (1, None)),
    ("everything is fine\n", None),
])
def test_the_first_failed_rank_is_read_from_each_launcher(output, expected):
    from hvdtrain.launch.failures import first_failed_rank
    assert first_failed_rank(output) == expected
