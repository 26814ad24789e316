"""The command-line options generated from the algorithms' config dataclasses, and the console helpers."""

import argparse
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


def _app_parsers():
    """Each app's full parser for each algorithm (the app's options and that algorithm's)."""
    from mpicomm.training.options import add_algorithm_options

    from .app_runs import app_module

    for name in ("train_resnet", "train_bert"):
        module = app_module(name)
        for algorithm in sorted(ALGORITHMS):
            parser = module.build_parser()
            add_algorithm_options(parser, algorithm)
            yield f"{name} --algorithm {algorithm}", parser


def _subparsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _subparsers(child)


def test_every_option_of_every_command_has_help_and_no_markup():
    """The apps' parsers (each with every algorithm's options) and every ``mpicomm`` sub-command."""
    from mpicomm.cli import _parser

    parsers = [*_app_parsers(), *(("mpicomm", p) for p in _subparsers(_parser()))]
    bare = [(where, a.option_strings) for where, p in parsers for a in p._actions
            if a.option_strings and a.help != "==SUPPRESS==" and not (a.help or "").strip()]
    assert bare == [], bare
    texts = [p.format_help() for _, p in parsers]
    assert not [t for t in texts if "``" in t or ":func:" in t]


def test_abbreviated_options_are_refused_and_momentum_defaults_to_what_recipes_use():
    """``--epoch 1`` was silently taken as ``--epochs``; momentum is 0.9 where the method takes it, else 0."""
    parsers = dict(_app_parsers())
    resnet = parsers["train_resnet --algorithm dpsgd"]
    with redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
        resnet.parse_args(["--epoch", "1"])
    assert "unrecognized arguments: --epoch 1" in err.getvalue()
    assert resnet.parse_args([]).momentum == 0.9
    assert parsers["train_resnet --algorithm d2"].parse_args([]).momentum == 0.0  # D²'s update has no momentum
    assert parsers["train_bert --algorithm allreduce_adam"].parse_args([]).momentum == 0.0  # Adam: beta1


def test_the_app_momentum_gives_way_to_an_inner_adamw_unless_typed():
    """``--inner-optimizer adamw`` takes no momentum: the untyped app default 0.9 becomes 0; a typed 0.9 is kept
    (and the config then refuses it with its message)."""
    from .app_runs import app_module

    def parse(*argv):
        return parse_app_args(app_module("train_bert").build_parser(), ["--algorithm", "diloco", *argv])

    assert parse().momentum == 0.9
    assert parse("--inner-optimizer", "adamw").momentum == 0.0
    assert parse("--inner-optimizer", "adamw", "--momentum", "0.9").momentum == 0.9
    assert parse("--inner-optimizer", "adamw", "--momentum=0.5").momentum == 0.5


def test_a_chosen_method_keeps_the_shared_options_its_config_accepts():
    """Adam's config wants momentum 0 (beta1 is its momentum): the shared momentum is left out, the rest kept;
    APMSqueeze without its warm-up length refuses its own options alone, so it gets everything (its own error
    then names what is missing); an inner AdamW takes no momentum either."""
    from mpicomm.training.options import accepted_options, accepts

    shared = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.1}
    assert accepted_options("allreduce_sgd", {}, shared) == shared
    assert accepted_options("allreduce_adam", {}, shared) == {"lr": 0.01, "weight_decay": 0.1}
    assert accepted_options("apmsqueeze", {"total_steps": 100}, shared) == {"total_steps": 100, "lr": 0.01,
                                                                            "weight_decay": 0.1}
    assert accepted_options("apmsqueeze", {}, shared) == shared
    assert accepted_options("diloco", {"inner_optimizer": "adamw"}, {"momentum": 0.9}) == {"inner_optimizer": "adamw"}
    assert accepts(ALGORITHMS["d2"].config_class, {"lr": 0.5}) and not accepts(ALGORITHMS["d2"].config_class,
                                                                                 {"momentum": 0.9})


ADAM_TYPE = ["allreduce_adam", "apmsqueeze", "zeroone_adam", "signsgd"]  # steps of about lr per coordinate
LAMB_TYPE = ["lamb", "onebit_lamb"]  # steps of lr times each layer's norm


def test_the_default_lr_is_the_family_s_in_both_apps_and_a_typed_lr_wins():
    """An Adam- or sign-type method starts at Adam's 1e-3 (Kingma & Ba's, torch.optim.Adam's), not SGD's 0.1, in
    both apps and whatever the other options, LAMB at 1e-2; an inner AdamW makes a local-update method Adam-type;
    D² (no momentum) and EF-SignSGD (given none) start at 0.25; ``--lr`` always wins."""
    from .app_runs import app_module

    def parse(app, *argv):
        return parse_app_args(app_module(app).build_parser(), list(argv)).lr

    assert parse("train_bert") == 1e-3  # its default method, apmsqueeze
    assert parse("train_bert", "--lr", "0.05") == 0.05
    assert parse("train_bert", "--algorithm", "allreduce_sgd") == 0.1
    assert parse("train_resnet") == 0.1  # its default method, moniqua
    for name in ("d2", "moniqua_d2", "ef_signsgd"):  # no momentum: the others' momentum 0.9 makes their step 10x lr
        assert parse("train_resnet", "--algorithm", name) == 0.25, name
        assert parse("train_resnet", "--algorithm", name, "--lr", "0.1") == 0.1, name
    resnet = app_module("train_resnet").build_parser
    assert parse_app_args(resnet(), ["--algorithm", "ef_signsgd"]).momentum == 0.0
    assert parse_app_args(resnet(), ["--algorithm", "ef_signsgd", "--momentum", "0.9"]).momentum == 0.9
    assert parse_app_args(resnet(), ["--algorithm", "powersgd"]).rank == 4  # rank 1 reaches 69.6 % in 120 steps
    assert parse_app_args(resnet(), ["--algorithm", "powersgd", "--rank", "1"]).rank == 1
    for name in LAMB_TYPE:
        assert parse("train_resnet", "--algorithm", name) == 1e-2, name
        assert parse("train_resnet", "--algorithm", name, "--lr", "0.05") == 0.05, name
    for name in ADAM_TYPE:
        assert parse("train_resnet", "--algorithm", name) == 1e-3, name
        assert parse("train_resnet", "--algorithm", name, "--lr", "0.05") == 0.05, name
        assert parse("train_resnet", "--algorithm", name, "--lr=0.2") == 0.2, name
    assert parse("train_resnet", "--algorithm", "allreduce_adam", "--beta2", "0.99") == 1e-3
    assert parse("train_resnet", "--algorithm", "diloco") == 0.1
    assert parse("train_resnet", "--algorithm", "diloco", "--inner-optimizer", "adamw") == 1e-3
    assert parse("train_resnet", "--algorithm", "diloco", "--inner-optimizer", "adamw", "--lr", "0.3") == 0.3


def test_the_library_s_adam_default_is_torch_s():
    """Built without an lr, AllReduce-Adam takes the step torch.optim.AdamW takes at its own default lr (1e-3);
    its config and every Adam-type method built by name say 1e-3, LAMB's 1e-2 (their configs once inherited SGD's
    0.1 through a base listed before theirs); an explicit lr wins."""
    import torch
    from mpi4py import MPI

    from mpicomm import topology
    from mpicomm.algorithms import make_algorithm
    from mpicomm.algorithms.centralized.adam import AllReduceAdam, AllReduceAdamConfig
    from mpicomm.algorithms.centralized.lamb import LAMBTwoLevelConfig
    from mpicomm.comm import Communicator

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)

    comm = Communicator(MPI.COMM_SELF, topology.ring(1))
    assert AllReduceAdamConfig().lr == 1e-3 and LAMBTwoLevelConfig().lr == 1e-2
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    ours, theirs = model(), model()
    algo = AllReduceAdam(ours, comm)
    reference = torch.optim.AdamW(theirs.parameters(), weight_decay=0.0)
    for _ in range(3):
        algo.zero_grad()
        torch.nn.functional.mse_loss(ours(x), y).backward()
        algo.step()
        reference.zero_grad()
        torch.nn.functional.mse_loss(theirs(x), y).backward()
        reference.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)
    for name in ADAM_TYPE + LAMB_TYPE:
        extra = {"warmup_steps": 1} if name == "apmsqueeze" else {}
        assert make_algorithm(name, model(), comm, **extra).lr == (1e-2 if name in LAMB_TYPE else 1e-3), name
        assert make_algorithm(name, model(), comm, lr=0.02, **extra).lr == 0.02, name
    assert make_algorithm("allreduce_sgd", model(), comm).lr == 0.1
    assert make_algorithm("diloco", model(), comm, inner_optimizer="adamw").lr == 1e-3
