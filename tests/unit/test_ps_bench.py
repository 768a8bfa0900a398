"""hvdtrain.bench.ps.driver's table: the counted bytes beside the formulas (no job launched)."""
from hvdtrain.bench.ps.driver import formulas, table


def test_the_formulas_are_the_seeds_less_the_servers_own_slice():
    psi = 1200
    assert formulas(psi, np=4, servers=1, rank=0) == 2 * 3 * psi  # 2 (N - 1) x Psi
    assert formulas(psi, np=4, servers=1, rank=3) == 2 * psi
    assert formulas(psi, np=4, servers=2, rank=1) == 2 * 3 * 600 + 2 * 1 * 600
    assert formulas(psi, np=4, servers=2, rank=2) == 2 * psi


def test_the_table_lists_every_rank_with_its_counted_bytes_and_formulas():
    result = {"np": 2, "servers": 1, "psi_bytes": 100, "traffic": [[100, 100], [100, 100]],
              "samples_per_sec": {"ps": 10.0, "ddp": 20.0}}
    lines = "\n".join(table([result])).splitlines()
    server = next(line for line in lines if " server " in line).split()
    worker = next(line for line in lines if " worker " in line).split()
    assert server[:8] == ["2", "0", "server", "100", "100", "200", "200", "400"]
    assert worker[:8] == ["2", "1", "worker", "100", "100", "200", "200", "200"]
