"""The command-line options generated from the algorithms' config dataclasses, and the console helpers."""

import dataclasses
import io
import warnings
from contextlib import redirect_stderr, redirect_stdout

import pytest

from mpicomm.algorithms import ALGORITHMS
from mpicomm.training.arguments import app_parser, parse_app_args
from mpicomm.training.console import Console, launcher_rank
from mpicomm.training.options import field_help


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_option_is_described_without_markup(name):
    config = ALGORITHMS[name].config_class
    described = field_help(config)
    fields = [f.name for f in dataclasses.fields(config)]
    assert [f for f in fields if not described.get(f)] == [], f"{name}: describe these in {config.__name__}"
    parser = app_parser("test", default_algorithm=name, epochs=1)
    with redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit):
        parse_app_args(parser, ["--algorithm", name, "--help"])
    text = out.getvalue()
    assert ":func:" not in text and ":class:" not in text and "``" not in text, text
    for field in fields:
        flag = "--" + field.replace("_", "-")
        assert flag in text, (flag, text)


def test_field_help_reads_grouped_and_sentence_forms():
    @dataclasses.dataclass(frozen=True)
    class Config:
        """Options.

        a/b_c: shared text, see :func:`~pkg.mod.helper`. d1: ``quoted`` thing; with (e.g. x: y) inside.
        """

        a: int = 0
        b_c: int = 0
        d1: int = 0

    assert field_help(Config) == {"a": "shared text, see helper", "b_c": "shared text, see helper",
                                  "d1": "quoted thing; with (e.g. x: y) inside"}


def test_console_prints_whole_lines_from_rank_0_only(capsys):
    Console("app", rank=1).error("not me")
    Console("app", rank=0).error("two\nlines")
    Console("app", rank=0).info("note")
    out, err = capsys.readouterr()
    assert err == "app: error: two; lines\n" and out == "app: note\n"


def test_console_quiets_other_ranks_and_routes_warnings(monkeypatch):
    noisy = io.StringIO()
    with redirect_stderr(noisy):
        with Console("app", rank=3).quiet_unless_rank0():
            print("usage: ...", file=__import__("sys").stderr)
    assert noisy.getvalue() == ""
    with warnings.catch_warnings():
        Console("app", rank=0).route_warnings()
        with redirect_stderr(io.StringIO()) as shown:
            warnings.warn("careful", UserWarning, stacklevel=1)
    assert shown.getvalue() == "app: warning: UserWarning: careful\n"
    monkeypatch.setenv("PMI_RANK", "5")
    assert launcher_rank() == 5
