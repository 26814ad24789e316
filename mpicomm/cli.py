"""The ``mpicomm`` command: ``demo``, ``plot``, ``export``, ``slurm`` and ``plan`` (training runs through ``apps/``).

Launch under MPI as ``mpiexec -n 4 mpicomm demo``. The entry point aborts the whole job when any
rank raises, so a failure never leaves other ranks blocked in a collective. ``plot``, ``export``,
``slurm`` and ``plan`` run without MPI, except ``plan --calibrate`` (under ``mpiexec``: it measures the transport).
"""

from __future__ import annotations

import argparse
import sys

from . import __version__

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpicomm", description=__doc__.splitlines()[0].replace("``", ""),
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"mpicomm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="one neighbour exchange per codec on a ring of all ranks")
    demo.add_argument("--numel", type=int, default=100_000, help="elements per rank (default 100000)")
    demo.add_argument("--theta", type=float, default=0.1, help="Moniqua bound theta (default 0.1)")
    plot = sub.add_parser("plot", help="PNG curves from metrics.jsonl files (accuracy vs epoch, time, bytes)")
    plot.add_argument("metrics", nargs="+", help="metrics.jsonl files written by the apps")
    plot.add_argument("-o", "--output", default="curves.png", help="the PNG to write (default curves.png)")
    plot.add_argument("--metric", default=None,
                      help="the evaluated metric to draw, e.g. test_loss, val_mlm_loss (default: each file's app's "
                           "own: test_accuracy for ResNet, val_mlm_accuracy for BERT)")
    plot.add_argument("--labels", default=None, help="comma-separated legend labels, one per file")
    export = sub.add_parser("export", help="a run's model as a torch state_dict file or a Hugging Face folder (no MPI)")
    export.add_argument("checkpoint", help="a run directory (its latest checkpoint), RUN_DIR/step-N or a checkpoint.h5")
    export.add_argument("-o", "--output", required=True,
                        help="the file to write (--format torch) or the folder (--format hf: new or empty)")
    export.add_argument("--format", default="torch", choices=["torch", "hf"],
                        help="torch: torch.save(state_dict); hf: save_pretrained folder (a transformers model: BERT)")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--average", action="store_true", help="the average of all ranks' models (the default)")
    which.add_argument("--rank", type=int, default=None, help="this rank's own model instead of the average")
    export.add_argument("--buffers", default="evaluated",
                        help="with the average: 'evaluated' (the default: the model exactly as the run's final "
                             "evaluation scored it, BatchNorm statistics recomputed for the averaged weights), "
                             "'average' (the ranks' BatchNorm statistics averaged) or a rank whose buffers to take")
    slurm = sub.add_parser("slurm", help="render, submit, check or regenerate sbatch templates (see slurm/)")
    slurm_sub = slurm.add_subparsers(dest="slurm_command", required=True)
    for name, text in (("render", "print the rendered template (or write it with -o)"),
                       ("submit", "render, write (-o, default mpicomm-job.sbatch) and sbatch it")):
        cmd = slurm_sub.add_parser(name, help=text)
        cmd.add_argument("template", help="a path, or a name in slurm/ (generic, resnet20_moniqua, ...)")
        cmd.add_argument("--preset", default="", help="start from a named preset's settings")
        cmd.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="an #SBATCH option (nodes, time, ...) or a parameter (ALGORITHM, EPOCHS, ...)")
        cmd.add_argument("-o", "--output", default="", help="the job file to write" + (
            " (default mpicomm-job.sbatch)" if name == "submit" else " (default: print it)"))
        if name == "submit":
            cmd.add_argument("--wait", action="store_true", help="sbatch --wait: return the job's exit code")
            cmd.add_argument("--sbatch-arg", action="append", default=[], help="extra argument for sbatch")
    slurm_sub.add_parser("regenerate", help="rewrite slurm/<preset>.sbatch from slurm/generic.sbatch")
    check = slurm_sub.add_parser("check", help="what would stop a rendered job: project, venv, app, data, options "
                                               "(one line each, exit 2), before it is queued")
    check.add_argument("job", nargs="+", help="the job files (mpicomm slurm render -o JOB.sbatch, or "
                                              "slurm/<preset>.sbatch)")
    from .plan.command import add_arguments as plan_arguments

    plan_arguments(sub.add_parser("plan", help="rank the methods and settings by predicted step time (no MPI; "
                                                  "--calibrate, under mpiexec, measures the transport)"))
    return parser


def _refuse(command: str, exc: Exception) -> int:
    """One line on stderr, exit status 2: the convention of every refused input (as argparse does)."""
    print(f"mpicomm {command}: error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the sub-command on every rank."""
    args = _parser().parse_args(argv)
    if args.command == "slurm":
        from .slurm import check, commands

        run = {"render": commands.main_render, "submit": commands.main_submit,
               "regenerate": commands.main_regenerate, "check": check.main_check}[args.slurm_command]
        try:
            return run(args)
        except ValueError as exc:
            return _refuse(f"slurm {args.slurm_command}", exc)
    if args.command == "export":
        from .export.command import main as export_main

        return export_main(args)
    if args.command == "plan":
        from .plan.command import calibrate_main
        from .plan.command import main as plan_main

        if args.calibrate:
            return calibrate_main(args)  # under MPI: its own lines and exit status on every rank

        try:
            print(plan_main(args))
        except ValueError as exc:
            return _refuse("plan", exc)
        return 0
    if args.command == "plot":
        from .training.plot import plot_runs

        labels = args.labels.split(",") if args.labels else None
        try:
            print(plot_runs(args.metrics, args.output, args.metric, labels))
        except ValueError as exc:
            return _refuse("plot", exc)
        return 0
    if args.numel <= 0:
        return _refuse("demo", ValueError(f"--numel must be a positive integer, got {args.numel}"))
    from .comm import abort_on_exception, world

    with abort_on_exception(world()):
        from .demo import run_demo

        run_demo(world(), numel=args.numel, theta=args.theta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
