"""The `hio` command: one subcommand per role, plus tools for users.

Each subcommand builds a frozen config object (defaults < file < environment <
flags) and calls one ``run_<name>(config) -> int``. Heavy imports (pyspark,
docker) happen inside the command that needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

# gRPC's C core logs each failed TLS handshake to stderr, unstructured, several times a
# second while a client retries; our own logs say it once, with what to fix. Before any
# import of grpc; GRPC_VERBOSITY set by the user still wins (and reaches child processes).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# No hio process uses gRPC in a forked child, and gRPC's fork support harms one that forks
# with Python code in the child, as pyspark does to start KD's driver JVM (a preexec_fn):
# while other threads are in gRPC calls, gRPC skips its fork handlers and its poller aborts
# about one such child in a hundred before exec. Off unless the user says.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from hio import __version__, commands
from hio import config as cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hio", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"hio {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_cls, _section, _run, help_text) in commands.COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def command_parser(name: str, cls: type) -> argparse.ArgumentParser:
    _c, section, _r, help_text = commands.COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"hio {name}", description=help_text)
    positional = getattr(cls, "POSITIONAL", None)
    if positional:
        _field, metavar, help_pos = positional
        # A destination of its own: sharing the flag's, the empty positional list would
        # replace what ``--<field>`` gave (``hio send --files a.txt`` would send nothing).
        parser.add_argument(POSITIONAL_DEST, metavar=metavar, nargs="*", help=help_pos)
    cfg.add_arguments(parser, cls, section)
    return parser


POSITIONAL_DEST = "positional_values"


def positional_override(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The command's positional values as its setting (``POSITIONAL``), after the values its
    flag gave: ``hio send a.txt --files b.txt`` sends both. Empty when none was given, so the
    flag, the environment or the file says it."""
    positional = getattr(cls, "POSITIONAL", None)
    given = getattr(args, POSITIONAL_DEST, None)
    if not positional or not given:
        return {}
    field = positional[0]
    return {field: (*cfg.flag_items(getattr(args, field) or []), *given)}


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's stack to stderr: what a role that seems
    stuck is doing, without stopping it."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        with contextlib.suppress(OSError, ValueError):  # stderr is not a file: called in-process (tests, notebooks)
            faulthandler.register(signal.SIGUSR1, all_threads=True)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own, maybe started to die with its parent
        from hio.process.procs import die_with_parent

        die_with_parent()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in commands.COMMANDS:
        parser = build_parser()
        if argv and argv[0] not in ("-h", "--help", "--version"):
            parser.print_usage(sys.stderr)
            print(f"hio: unknown command '{argv[0]}'; choose from: {', '.join(commands.COMMANDS)}", file=sys.stderr)
            return 2
        parser.parse_args(argv or ["--help"])
        return 0
    name, rest = argv[0], argv[1:]
    cls_path, section, run_path, _help = commands.COMMANDS[name]
    try:
        cls = commands.load(cls_path)
        args = command_parser(name, cls).parse_args(rest)
        config = cfg.build(cls, section, args, overrides=positional_override(cls, args))
        from hio.process.log import setup_logging
        from hio.process.memory import tune_process

        setup_logging(getattr(config, "log_level", "warning"), getattr(config, "log_json", False))
        _stacks_on_sigusr1()
        run: Callable[[Any], int] = commands.load(run_path)
        tune_process()  # tuple buffers reused instead of faulted in per copy; start-up objects out of the GC's way
        return int(run(config) or 0)
    except (cfg.ConfigError, commands.CommandUnavailable) as exc:
        print(f"hio {name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `hio knowledge | head`: the reader left; nothing more to say, no traceback
        _quiet_stdout()
        return 1
    except OSError as exc:
        if exc.errno not in _ENVIRONMENT_ERRNOS:
            raise
        # the machine's state, not a defect: a full disk, a data dir that is a file or not ours
        logging.getLogger("hio").debug("stopped by the environment", exc_info=True)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"hio {name}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1


# OS errors that say what is wrong with the machine (named in one line, no traceback)
_ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST}
)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so flushing it at exit cannot fail again (the Python docs' recipe)."""
    with contextlib.suppress(OSError, ValueError):  # stdout is not a file descriptor (called in-process)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
