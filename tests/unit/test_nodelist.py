import pytest

from hvdtrain.distributed.environments.nodelist import NodelistError, expand_nodelist


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
    ("a[1-2],b[3-4]", ["a1", "a2", "b3", "b4"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),   # padding kept across a digit boundary
    ("x[8-11]", ["x8", "x9", "x10", "x11"]),                # no padding asked, none added
    ("single", ["single"]),
    ("host1,host2", ["host1", "host2"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),     # several brackets: their product
    ("c[5]", ["c5"]),
    ("login.cluster.org", ["login.cluster.org"]),
])
def test_slurm_host_lists_expand_as_scontrol_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist,message", [
    ("", "empty host list"),
    ("node[1-", r"'\[' without '\]'"),
    ("node]1", r"'\]' without '\['"),
    ("node[4-2]", "runs backwards"),
    ("node[a-b]", "bad range 'a-b'"),
    ("node[1,,2]", "bad range ''"),
    ("node[[1]]", "nested"),
    ("a,,b", "bad host name ''"),
    ("bad host", "bad host name 'bad host'"),
    ("evil;rm[1-2]", "bad host name part 'evil;rm'"),
])
def test_malformed_host_lists_are_refused_with_the_reason(nodelist, message):
    with pytest.raises(NodelistError, match=message):
        expand_nodelist(nodelist)
