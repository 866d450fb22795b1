"""``megadiv bounds`` through the real entry point, megadiv.cli.main."""
import re

from megadiv.cli import main
from megadiv.divergence import ratio_bounds


def run_cli(capsys, *argv):
    rc = main(["bounds", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_interval(capsys):
    rc, out, _ = run_cli(capsys, "--measure", "k3", "--delta", "0.02")
    assert rc == 0
    low, high = ratio_bounds("k3", 0.02)
    assert out.strip() == (f"k3(w) <= 0.02  <=>  w in [{low:.10f}, {high:.10f}]  "
                           f"(eps_low {1 - low:.6f}, eps_high {high - 1:.6f})")
    assert "[0.8131051152, 1.2135497072]" in out


def test_several_measures_and_deltas(capsys):
    rc, out, _ = run_cli(capsys, "--measure", "k2", "ratio", "--delta", "0.01", "0.05")
    assert rc == 0 and len(out.strip().splitlines()) == 4
    assert "ratio(w) <= 0.05  <=>  w in [0.9500000000, 1.0500000000]" in out


def test_equivalent_deltas(capsys):
    rc, out, _ = run_cli(capsys, "--measure", "k3", "k1", "--eps-low", "0.2", "--eps-high", "0.28")
    assert rc == 0
    assert "k3: w in [0.8, 1.28]  <=>  delta_low 0.023144 (w < 1 side), delta_high 0.033140 (w > 1 side)" in out
    assert "k1: w in [0.8, 1.28]  <=>  delta_low 0.223144 (w < 1 side), delta_high - (w > 1 side)" in out


def test_table(capsys):
    rc, out, _ = run_cli(capsys, "--table")
    assert rc == 0
    interval_block, equivalence_block = out.split("Deltas equivalent")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in interval_block.splitlines()
            if re.match(r"^(k1|k2|k3|ratio|reverse_k3)\s+\d", line)}
    assert len(rows) == 5 * 6
    assert rows[("k3", "0.05")][:2] == ["0.716189", "1.350403"]
    assert rows[("ratio", "0.2")][:2] == ["0.800000", "1.200000"]
    assert rows[("k1", "0.1")][1] == "inf"
    # the PPO / DAPO equivalence block: k3 row gives methods.md's 0.0231 / 0.0331
    k3 = next(line for line in equivalence_block.splitlines() if line.startswith("k3 ")).split()
    assert k3 == ["k3", "0.023144", "0.017678", "0.023144", "0.033140"]
    assert "PPO [0.8, 1.2]" in equivalence_block and "DAPO [0.8, 1.28]" in equivalence_block


def test_errors(capsys):
    for argv, message in ((["--measure", "sampled_prob_l2", "--delta", "0.1"], "not a function of the ratio"),
                          (["--delta", "0"], "delta must be a finite number > 0"),
                          (["--measure", "k9", "--delta", "0.1"], "unknown divergence measure"),
                          ([], "give --delta, --eps-low or --table"),
                          (["--delta", "0.1", "--eps-low", "0.2"], "either --delta or --eps-low")):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and out == "" and message in err, (argv, err)
