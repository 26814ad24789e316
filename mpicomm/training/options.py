"""Command-line options generated from the config dataclasses, so the CLI never drifts from the code.

``algorithm_options(parser, name)`` adds one ``--field-name`` per field of the algorithm's config
dataclass; ``config_kwargs(args, name)`` collects them back. Booleans become ``--flag/--no-flag``;
fields whose default is ``None`` or whose type is a union accept a number or a word (``--theta 0.05``
or ``--theta adaptive``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from ..algorithms import ALGORITHMS
from ..algorithms.registry import default_lr, lr_family

__all__ = ["APP_DEFAULTS", "APP_OPTIONS", "LR_WITHOUT_MOMENTUM", "accepted_options", "accepts",
           "add_algorithm_options", "add_config_options", "app_lr", "config_kwargs", "field_help", "foreign_option",
           "key_values", "number_or_word", "settle_app_defaults"]


def number_or_word(text: str):
    """Parse ``text`` as an int, else a float, else keep the string (``"none"`` becomes ``None``)."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return None if text.lower() == "none" else text


def key_values(text: str) -> dict:
    """Parse ``"bits=4,bucket_size=128"`` into ``{"bits": 4, "bucket_size": 128}`` (empty string: ``{}``)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {item!r}")
        out[key.strip()] = number_or_word(value.strip())
    return out


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _converter(field: dataclasses.Field):
    default = _default(field)
    if isinstance(default, dict):
        return key_values
    if default is None or "|" in str(field.type) or "Union" in str(field.type):
        return number_or_word
    return type(default)


def _plain(text: str) -> str:
    """Docstring text without Sphinx markup (``:func:`~a.b`` -> ``b``, double backticks -> nothing)."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`", r"\1", text)
    return " ".join(text.replace("``", "").split())


def field_help(config_class) -> dict[str, str]:
    """Each field's description, read from the config classes' docstrings (``name: text`` or ``a/b: text``).

    The docstrings are the single place options are described; this keeps ``--help`` from drifting.
    """
    names = {f.name for f in dataclasses.fields(config_class)}
    out: dict[str, str] = {}
    for cls in reversed(config_class.__mro__):
        doc = _plain(getattr(cls, "__doc__", "") or "")
        labels = [m for m in re.finditer(r"(?<![\w/])([A-Za-z_]\w*(?:/[A-Za-z_]\w*)*):\s", doc)
                  if set(m.group(1).split("/")) <= names]
        for label, following in zip(labels, labels[1:] + [None]):
            text = doc[label.end():following.start() if following else len(doc)].strip().rstrip(".;,")
            for field_name in label.group(1).split("/"):
                out[field_name] = text
    return out


APP_DEFAULTS = {"momentum": 0.9}
"""Where the apps' command line differs from the library's defaults: momentum 0.9, what every recipe the
results use trains with (the library keeps 0, plain SGD), for each algorithm whose config accepts it (and,
see :func:`settle_app_defaults`, whose other options on the command line leave room for it), unless
:data:`APP_OPTIONS` says otherwise. ``--lr`` is the library's own per-family default
(:func:`~mpicomm.algorithms.registry.default_lr`), except :data:`LR_WITHOUT_MOMENTUM` (see :func:`app_lr`)."""

APP_OPTIONS = {
    "ef_signsgd": {"momentum": 0.0},
}
"""Per method, the apps' defaults that differ from the library's (beyond :data:`APP_DEFAULTS`), measured on the
ResNet app's digits (2 ranks, 120 steps; AllReduce-SGD 98.3 %; ``bench/training/defaults_sweep.py``):

* ``ef_signsgd``: no momentum (and ``--lr`` :data:`LR_WITHOUT_MOMENTUM`): its error feedback compresses the step
  lr g + e, and momentum on the compressed steps re-applies, for about ten more steps, corrections the feedback
  has already made: 96.7 % without, 43 % with momentum 0.9 at lr 0.1 (66 steps).

(PowerSGD's rank 4, measured the same way -- rank 1 reached 69.6 %, rank 2 86.9 %, rank 4 97.2 %, at 1/35, 1/19
and 1/10 of AllReduce-SGD's bytes -- is the library's default, so the apps need no entry for it.)
"""

LR_WITHOUT_MOMENTUM = 0.25
"""The apps' ``--lr`` for an SGD-type method that takes no momentum (D², Moniqua-D²: their update has no
momentum term; EF-SignSGD: :data:`APP_OPTIONS`). The others train with the apps' momentum 0.9, an effective step of
lr / (1 - 0.9) = 1.0 at lr 0.1; without it, lr 0.1 is a step ten times smaller. Measured on the ResNet app's
digits (2 ranks, 120 steps, where D² is plain SGD): D² reaches 87.7 % at lr 0.1, 97.2 % at 0.25 and 46 % at 0.5
(its loss rises to 4.7 in the first 10 steps), against AllReduce-SGD's 98.3 % (``bench/training/defaults_sweep.py``)."""


def app_lr(name: str, options: dict | None = None) -> float:
    """The apps' default ``--lr`` for algorithm ``name`` with config ``options``: the library's
    :func:`~mpicomm.algorithms.registry.default_lr`, or :data:`LR_WITHOUT_MOMENTUM` for an SGD-type method that
    refuses the apps' momentum or is given none (:data:`APP_OPTIONS`)."""
    if lr_family(name, options) == "sgd" and (APP_OPTIONS.get(name, {}).get("momentum") == 0.0 or not accepts(
            ALGORITHMS[name].config_class, {"momentum": APP_DEFAULTS["momentum"]})):
        return LR_WITHOUT_MOMENTUM
    return default_lr(name, options)


def _app_default(config_class, field: dataclasses.Field, overrides: dict):
    """``field``'s default on the command line: ``overrides``' value, else :data:`APP_DEFAULTS`' where the
    config accepts it, else the config's."""
    if field.name in overrides:
        return overrides[field.name]
    if field.name in APP_DEFAULTS and accepts(config_class, {field.name: APP_DEFAULTS[field.name]}):
        return APP_DEFAULTS[field.name]
    return _default(field)


def add_algorithm_options(parser: argparse.ArgumentParser, name: str) -> None:
    """Add the options of algorithm ``name``'s config (``--lr``, ``--bits``, …) to ``parser``."""
    if name not in ALGORITHMS:
        parser.error(f"--algorithm: unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)} or auto")
    cls = ALGORITHMS[name]
    first_line = _plain((cls.__doc__ or cls.config_class.__doc__ or name).strip().splitlines()[0])
    add_config_options(parser.add_argument_group(f"{name} options", first_line), cls.config_class,
                       {"lr": app_lr(name), **APP_OPTIONS.get(name, {})})


def add_config_options(group, config_class, overrides: dict | None = None) -> None:
    """Add one option per field of the dataclass ``config_class`` to the argparse ``group`` (``overrides``:
    defaults that replace the config's, by field name)."""
    described = field_help(config_class)
    for field in dataclasses.fields(config_class):
        flag = "--" + field.name.replace("_", "-")
        default = _app_default(config_class, field, overrides or {})
        if default is dataclasses.MISSING:
            continue
        text = described.get(field.name, "")
        if isinstance(default, dict):
            text = f"{text} (KEY=VALUE,...)".strip()
        if isinstance(default, bool):
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                               help=text.replace("%", "%%") or " ")
        else:
            group.add_argument(flag, dest=field.name, type=_converter(field), default=default,
                               metavar=field.name.upper(), help=text.replace("%", "%%") or " ")


def _flags(config_class) -> set[str]:
    """The command-line flags :func:`add_algorithm_options` makes of ``config_class`` (``--no-X`` included)."""
    out = set()
    for field in dataclasses.fields(config_class):
        flag = "--" + field.name.replace("_", "-")
        out.add(flag)
        if isinstance(_default(field), bool):
            out.add("--no-" + flag[2:])
    return out


def foreign_option(parser: argparse.ArgumentParser, name: str, argv: list[str]) -> str:
    """The refusal of the first flag in ``argv`` that only other algorithms take (``--overlap`` with ``dcd``),
    naming those that take it; ``""`` when there is none (an unknown flag is left to argparse)."""
    known = set(parser._option_string_actions)
    for token in argv:
        flag = token.split("=", 1)[0]
        if not flag.startswith("--") or flag in known:
            continue
        owners = sorted(other for other, cls in ALGORITHMS.items() if flag in _flags(cls.config_class))
        if not owners:
            continue
        if flag == "--overlap":
            return (f"{flag}: {name} cannot overlap its exchange with compute; the methods that can: "
                    f"{', '.join(owners)}")
        return f"{flag} is not an option of {name} (it is one of {', '.join(owners)}; --algorithm {name} --help " \
               f"lists {name}'s)"
    return ""


def config_kwargs(args: argparse.Namespace, name: str) -> dict:
    """The config fields of algorithm ``name`` as found on ``args`` (only those that differ from the library's
    defaults)."""
    out = {}
    for field in dataclasses.fields(ALGORITHMS[name].config_class):
        if hasattr(args, field.name) and getattr(args, field.name) != _default(field):
            out[field.name] = getattr(args, field.name)
    return out


def settle_app_defaults(args: argparse.Namespace, name: str, argv: list[str]) -> None:
    """Give an :data:`APP_DEFAULTS` value the user did not type back to the library's default where the
    algorithm's other options refuse it and accept the library's (``--inner-optimizer adamw`` takes no
    momentum: 0 then), and an untyped ``--lr`` the :func:`app_lr` of the options given (``--inner-optimizer
    adamw``: Adam's). A value typed in ``argv`` is kept, so a real contradiction still gets its error."""
    typed = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    if "--lr" not in typed and hasattr(args, "lr"):
        args.lr = app_lr(name, config_kwargs(args, name))
    fields = {f.name: f for f in dataclasses.fields(ALGORITHMS[name].config_class)}
    for key, value in APP_DEFAULTS.items():
        if key not in fields or "--" + key.replace("_", "-") in typed or getattr(args, key, None) != value:
            continue
        others = {k: v for k, v in config_kwargs(args, name).items() if k != key}
        if key not in accepted_options(name, others, {key: value}):
            setattr(args, key, _default(fields[key]))


def accepts(config_class, options: dict) -> bool:
    """Whether the config dataclass ``config_class`` takes ``options`` (its checks raise no error)."""
    try:
        config_class(**options)
    except (ValueError, TypeError):
        return False
    return True


def accepted_options(name: str, own: dict, shared: dict) -> dict:
    """Algorithm ``name``'s options: ``own``, and each of the ``shared`` ones (lr, momentum, …) its config accepts
    beside them, in order (an Adam-type method refuses momentum: its default stays). A config that refuses
    ``own`` alone (it needs an option the caller must give) gets everything, for its own error to name."""
    config_class = ALGORITHMS[name].config_class
    kept = dict(own)
    if not accepts(config_class, kept):
        return {**kept, **shared}
    for key, value in shared.items():
        if accepts(config_class, {**kept, key: value}):
            kept[key] = value
    return kept
