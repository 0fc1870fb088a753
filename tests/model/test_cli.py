"""The commands that read a checkpoint find the bundled model without --checkpoint from any directory: `folio
sample`, `eval` and `inspect` as `folio serve` does (model/cli.py's one default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Settings
from model import eval as model_eval
from model import generate
from model import inspection as model_inspect


def test_sample_eval_and_inspect_read_the_bundled_model_outside_the_repository(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """From a directory with no weights/ in it: each command without --checkpoint does what it does with the bundled
    model named, the model `folio serve` serves by default."""
    served = Settings.model_fields["checkpoint"].default  # what `folio serve` serves without --checkpoint
    assert served.is_absolute() and (served / "config.json").is_file()
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("ROMEO:\nWherefore art thou Romeo?\n")
    named = ["--checkpoint", str(served)]
    runs = {
        "sample": (generate.main, ["--prompt", "ROMEO:", "--max-new-tokens", "12", "--greedy"]),
        "eval": (model_eval.main, ["--data", str(text)]),
        "inspect": (model_inspect.main, ["--text", "ROMEO:", "--layers", "0", "--heads", "0", "--out"]),
    }
    for name, (main, args) in runs.items():
        outputs = []
        for extra in ([], named):
            out = [str(tmp_path / f"{name}-{len(extra)}")] if name == "inspect" else []
            assert main([*args, *out, *extra]) == 0, (name, capsys.readouterr().err)
            outputs.append(capsys.readouterr().out.replace(f"{name}-{len(extra)}", f"{name}-N"))
        assert outputs[0] == outputs[1] and outputs[0], name
    assert sorted(p.name for p in (tmp_path / "inspect-0").iterdir()) == ["attention-L0-H0.png", "logit-lens.png"]
