"""The command dispatcher: version, typo hints, and quiet ends for Ctrl-C and closed pipes."""

from __future__ import annotations

import pytest

from redrafter_mlx import cli


def test_version_and_did_you_mean(capsys):
    cli.main(["--version"])
    assert capsys.readouterr().out.startswith("redrafter-mlx 0.")
    with pytest.raises(SystemExit) as e:
        cli.main(["chta"])
    assert e.value.code == 2
    assert "did you mean 'chat'?" in capsys.readouterr().err


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        cli.run(interrupted, None)
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted"
