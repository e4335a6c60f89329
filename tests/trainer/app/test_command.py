import pytest
from dgpo_ops.trainer.app import command as cli

from dgpo_ops.methods.table import GATES, METHODS


def test_table_lists_every_method_for_both_signs(capsys):
    assert cli.main(["table"]) == 0
    out = capsys.readouterr().out
    for name in [m for m in METHODS if m != "sapo"] + [f"sapo {gate}" for gate in GATES]:
        assert f"\n{name} " in out
    assert out.count("\ndgpo ") == 2


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "atlas.png"
    assert cli.main(["plot", "--out", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
