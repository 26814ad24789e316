"""Every option's ``--help`` line, for both apps and every algorithm: no empty or unset default shown, no empty
choice, no stale words, no option without a description."""

import functools
import re

import pytest

from mpicomm.algorithms import ALGORITHMS
from mpicomm.training.options import add_algorithm_options

from .app_runs import app_module

STALE = ("still to be run", "not yet measured", "TODO", "XXX")


@functools.cache
def _app(name: str):
    return app_module(name)


def _parser(app: str, algorithm: str):
    parser = _app(app).build_parser()
    add_algorithm_options(parser, algorithm)
    return parser


def _helps(app: str, algorithm: str) -> str:
    return _parser(app, algorithm).format_help()


@pytest.mark.parametrize("app", ["train_resnet", "train_bert"])
def test_every_option_of_every_algorithm_has_a_clean_help(app):
    problems = []
    for algorithm in sorted(ALGORITHMS):
        text = " ".join(_helps(app, algorithm).split())  # unwrapped: a phrase may span lines
        for pattern, what in ((r"\(default: \)", "an empty default"), (r"\(default: None\)", "an unset default"),
                              (r"\{,|,\}|,,", "an empty choice"),
                              (r"\(default [^()]*\) \(default: ", "its default twice")):
            problems += [f"{algorithm}: {what}: ...{m.group(0)}" for m in re.finditer(pattern, text)]
        problems += [f"{algorithm}: stale words {word!r}" for word in STALE if word in text]
    assert not problems, "\n".join(sorted(set(problems)))


def test_every_option_says_what_it_does():
    for app in ("train_resnet", "train_bert"):
        for algorithm in sorted(ALGORITHMS):
            parser = _parser(app, algorithm)
            bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not (a.help or "").strip()]
            assert not bare, f"{app} --algorithm {algorithm}: options without a description: {bare}"
