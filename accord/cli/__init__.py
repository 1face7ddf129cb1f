"""The `accord` command line: `accord run`, and whatever subcommands are registered below.

The tools live in this package, above the library they drive: `accord run`
(run.py, with _child.py in each rank and _output.py for their lines), `accord
bench` (bench.py; bench_worker.py and bench_p2p.py in the ranks), `accord
doctor` (doctor.py) and `accord debug` (debug.py). Nothing in the library imports
them.

Each subcommand lives in its own module, imported only when that subcommand
runs (so `accord run` never pays for importing the benchmark code). A module
provides two functions:

    add_arguments(parser)   # fill an argparse.ArgumentParser
    main(args) -> int       # run with the parsed namespace; return the exit status

Adding a subcommand is one line in COMMANDS.
"""
import argparse
import importlib
import os
import sys
from typing import NamedTuple

# The directory accord is imported from (a source tree or site-packages): the ranks
# that bench and doctor start are given it, so they import this same accord.
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Command(NamedTuple):
    name: str
    module: str   # imported lazily; provides add_arguments(parser) and main(args)
    summary: str  # one line for `accord --help`


COMMANDS = (
    Command("run", "accord.cli.run", "start N ranks of a Python script or module, like torchrun"),
    Command("bench", "accord.cli.bench",
            "time accord's collectives, side by side with gloo and MPI"),
    Command("doctor", "accord.cli.doctor", "check this host: /dev/shm, network, ports, torch, MPI"),
    Command("debug", "accord.cli.debug", "`debug analyze DIR`: the first divergence in a job's "
                                     "flight recorders"),
)


def _version():
    try:
        from importlib.metadata import version
        return version("accord")
    except Exception:
        return "unknown"


def _top_help():
    width = max(len(c.name) for c in COMMANDS)
    lines = ["usage: accord <command> [options] ...", "",
             "accord: collective communication for Python processes "
             "(the torch.distributed model).", "", "commands:"]
    lines += [f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS]
    lines += ["", "`accord <command> --help` describes a command's options.",
              "`python -m accord ...` is the same program."]
    return "\n".join(lines) + "\n"


def build_parser(command):
    """The argparse parser of one subcommand (imports that subcommand's module)."""
    module = importlib.import_module(command.module)
    parser = argparse.ArgumentParser(prog=f"accord {command.name}",
                                     description=command.summary)
    module.add_arguments(parser)
    return module, parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        (sys.stdout if argv else sys.stderr).write(_top_help())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"accord {_version()}")
        return 0
    by_name = {c.name: c for c in COMMANDS}
    command = by_name.get(argv[0])
    if command is None:
        sys.stderr.write(_top_help())
        sys.stderr.write(f"\naccord: error: unknown command {argv[0]!r} "
                         f"(choose from {', '.join(by_name)})\n")
        return 2
    module, parser = build_parser(command)
    args = parser.parse_args(argv[1:])
    status = module.main(args)
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
