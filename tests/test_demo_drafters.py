"""`demo-model --drafter TYPE`: a random drafter of each field type, in its authors' layout,
that loads as that type and decodes the demo model exactly (the offline rehearsal)."""

from __future__ import annotations

import json

import pytest

from redrafter_mlx.cli import main
from redrafter_mlx.core.errors import ConfigError
from redrafter_mlx.io.demo_drafters import KINDS, write_demo_drafter
from redrafter_mlx.io.field_drafters import drafter_kind


@pytest.mark.parametrize("kind", KINDS)
def test_demo_drafter_loads_as_its_type_and_keeps_the_answer(kind, tmp_path, capsys):
    model = tmp_path / "demo"
    main(["demo-model", "--out", str(model), "--drafter", kind])
    drafter = tmp_path / f"demo-{kind}"
    assert f"wrote {drafter}" in capsys.readouterr().out
    assert drafter_kind(drafter) == kind
    answers = {}
    runs = {"speculative": ["--drafter", str(drafter)], "plain": ["--autoregressive"]}
    for name, extra in runs.items():
        main(["generate", "--model", str(model), "--prompt", "Hello there", "--max-tokens", "12",
              "--json", *extra])  # fmt: skip
        answers[name] = json.loads(capsys.readouterr().out)
    assert answers["speculative"]["mode"] == "redrafter"
    assert answers["speculative"]["drafter"]["path"] == str(drafter)
    assert answers["speculative"]["tokens"] == answers["plain"]["tokens"]


def test_demo_drafter_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ConfigError, match="one of eagle3, dflash, dflash2, mtp"):
        write_demo_drafter(tmp_path / "d", tmp_path, "dflash9")
    with pytest.raises(ConfigError, match="not a model config"):
        write_demo_drafter(tmp_path / "d", tmp_path, "eagle3")
    assert not (tmp_path / "d").exists()
