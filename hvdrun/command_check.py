"""The job's command, checked on this machine before any process starts.

A program that does not exist ends hvdrun as a shell ends (``command not found``, exit 127);
one that exists but cannot be run (a file without the execute bit, a directory, a script
whose ``#!`` interpreter does not exist) as a shell does too (``permission denied``, ``bad
interpreter``, exit 126). For ``python [OPTIONS] SCRIPT`` a missing script (whatever its
name: python runs any file, directory or zip given to it) is refused (exit 2, what python
exits with), wherever python's own options put it.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from collections.abc import Sequence

import click

from launcher.spec.environment import file_here_hint
from launcher.spec.job import is_python

#: python's options that take no value and still run a script (``python -h`` lists them);
#: they may be combined (``-uB``). Any other letter (``-c``, ``-m``, ``-h``, ``-V``) runs no
#: script or is not python's: the check is then skipped.
_PYTHON_FLAGS = frozenset("bBdEiIOPqRsSuvx")
#: python's options that take a value, attached (``-Werror``) or as the next argument.
_PYTHON_VALUE_OPTIONS = frozenset("WX")


class CommandNotFound(click.ClickException):
    exit_code = 127


class CommandNotExecutable(click.ClickException):
    exit_code = 126  # what a shell exits with for a command it finds but cannot run


class ScriptNotFound(click.ClickException):
    exit_code = 2  # what python itself exits with for a missing script


def check_command(command: Sequence[str], path: str | None = None) -> None:
    """Catch a missing or unrunnable program, or a missing script, before any process starts.
    ``path``: the workers' ``PATH`` (``-x PATH=...`` may give them another than hvdrun's)."""
    program = command[0]
    found = shutil.which(program, path=path)
    if found is None:
        _not_runnable(program, path)
    else:
        _check_interpreter(program, found)
    if is_python(program):
        script = python_program(command[1:])
        if script == STDIN:
            raise ScriptNotFound(
                f"{' '.join(command)} reads its program from stdin, and the workers' stdin is "
                "/dev/null (hvdrun passes its own to no worker): give the script as a file "
                "(python train.py)"
            )
        if script is not None and not os.path.exists(script):
            if _unreachable(script):
                raise ScriptNotFound(
                    f"cannot read script {shown(script)}: permission denied (a directory on "
                    "its path is not open to this user)"
                )
            raise ScriptNotFound(f"script not found: {shown(script)} (in {os.getcwd()})")


#: hvdrun's packages that a worker's ``import collectives.torch`` (or another frontend) imports.
WORKER_PACKAGES = ("collectives", "rendezvous")


def hidden_packages_note(command: Sequence[str]) -> str | None:
    """A warning where the directory of the job's Python script holds a module or package
    named as one of :data:`WORKER_PACKAGES`: Python puts that directory first on the workers'
    ``sys.path``, so it hides hvdrun's own and ``import collectives.torch`` fails in every
    worker (hvdrun's source tree itself is not such a directory)."""
    if not is_python(command[0]):
        return None
    script = python_program(command[1:])
    if script is None or script == STDIN or not os.path.isfile(script):
        return None
    directory = os.path.dirname(os.path.realpath(script))
    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if directory == ours:
        return None
    hiding = []
    for name in WORKER_PACKAGES:
        module, package = os.path.join(directory, name + ".py"), os.path.join(directory, name)
        if os.path.isfile(module):
            hiding.append(module)
        if os.path.isfile(os.path.join(package, "__init__.py")):
            hiding.append(package)
    if not hiding:
        return None
    return (
        f"warning: {' and '.join(hiding)} hide{'s' if len(hiding) == 1 else ''} hvdrun's "
        f"package{'' if len(hiding) == 1 else 's'} of that name from the workers (Python puts "
        "the script's directory first on sys.path), so their import collectives.torch (or "
        "another frontend) fails: rename " + ("it" if len(hiding) == 1 else "them")
    )


def stdin_note(fd: int = 0) -> list[str]:
    """A note where hvdrun's stdin is a file with something in it, unread (``hvdrun ... <
    data``): no worker reads it, where mpirun would give it to rank 0. (A pipe may hold
    nothing, a scheduler's or a CI's, and says nothing; nor does a file read from already,
    the script of a shell run as ``bash < job.sh`` that started hvdrun.)"""
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size == 0:
            return []
        if os.lseek(fd, 0, os.SEEK_CUR) != 0:
            return []
    except OSError:
        return []
    return [
        "note: hvdrun's stdin is a file (hvdrun ... < FILE) that no worker reads: their stdin "
        "is /dev/null (mpirun would give it to rank 0); pass the file's name to the script"
    ]


def _not_runnable(program: str, search_path: str | None) -> None:
    """Raises the error a shell gives for ``program``, which ``shutil.which`` did not find
    on ``search_path`` (None: this process's ``PATH``)."""
    if not program.strip():
        raise CommandNotFound(f"command not found: {program!r} (the command's first word is empty)")
    # A bare name is looked up on PATH, where a file without the execute bit counts as found.
    path = (
        program
        if os.sep in program
        else shutil.which(program, mode=os.F_OK, path=search_path) or ""
    )
    if path and os.path.isdir(path):
        raise CommandNotExecutable(f"permission denied: {program} is a directory")
    if path and os.path.exists(path):
        how = (
            f"run it with python {program}, or chmod +x"
            if program.endswith(".py")
            else f"chmod +x {program}, or run it with its interpreter"
        )
        raise CommandNotExecutable(f"permission denied: {program} is not executable ({how})")
    here = file_here_hint(program, os.getcwd())
    if here is not None:
        raise CommandNotFound(f"command not found: {program} (a file here: {here})")
    if os.sep in program and _unreachable(program):
        raise CommandNotExecutable(
            f"permission denied: {shown(program)} (a directory on its path is not open to this "
            "user)"
        )
    if program in _SHELL_BUILTINS:
        raise CommandNotFound(
            f"command not found: {program} (a shell builtin: run the command through a shell, "
            f"sh -c '{program} ...')"
        )
    if _ASSIGNMENT.match(program):
        raise CommandNotFound(
            f"command not found: {program} (a variable for the workers? give it with "
            f"-x {program}, before the command)"
        )
    if any(ch.isspace() for ch in program):
        raise CommandNotFound(
            f"command not found: {program!r} (one word with blanks in it: was the whole command "
            "quoted as one? give its words separately, e.g. hvdrun -np 2 python train.py)"
        )
    if shown(program) != program:
        raise CommandNotFound(
            f"command not found: {program!r} (it holds characters that do not print)"
        )
    if is_python(program) and os.sep not in program:
        raise CommandNotFound(
            f"command not found: {program} (the workers' PATH has none: hvdrun runs on "
            f"{sys.executable}; give that path, or activate its virtualenv)"
        )
    raise CommandNotFound(f"command not found: {program}")


def _unreachable(path: str) -> bool:
    """Whether ``path`` cannot be looked at for want of permission (a directory on the way
    that this user may not enter): it may well exist."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def shown(word: str) -> str:
    """``word`` as an error shows it: quoted, with escapes, where blanks or characters that
    do not print (a newline) would hide what it is."""
    if word.isprintable() and not any(ch.isspace() for ch in word):
        return word
    return repr(word)


#: ``NAME=value`` as a command's first word: a shell's assignment, which exec runs as a program.
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


#: Shell builtins that are no program (``cd``, ``source``): a shell runs them, not exec.
_SHELL_BUILTINS = frozenset(
    {"cd", "source", ".", "export", "alias", "ulimit", "umask", "set", "unset", "eval", "exec"}
)


def _check_interpreter(program: str, path: str) -> None:
    """A script's ``#!`` line must name an interpreter that exists (as a shell says,
    ``bad interpreter``): every worker would fail with "No such file or directory" for a file
    that is there."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError:
        return
    if not head.startswith(b"#!"):
        return  # a program, or a format the kernel may know (binfmt_misc)
    line = head[2:].split(b"\n", 1)[0]
    if line.endswith(b"\r"):
        raise CommandNotExecutable(
            f"bad interpreter: {program}'s #! line ends in a carriage return (Windows line "
            "endings): convert the file (dos2unix) or run it with its interpreter"
        )
    words = line.split()
    interpreter = os.fsdecode(words[0]) if words else ""
    if not interpreter or not os.path.exists(interpreter):
        raise CommandNotExecutable(
            f"bad interpreter: {program}'s #! line names {interpreter or 'nothing'}, which "
            "does not exist here"
        )


#: What :func:`python_program` answers for a python that reads its program from stdin.
STDIN = "-"


def python_program(args: Sequence[str]) -> str | None:
    """The script ``python ARGS`` runs, past python's own options: :data:`STDIN` where it
    reads its program from stdin (``-``, or no script after its options: its prompt); None
    where it runs none (``-c``, ``-m``, ``--help``) or an option is not one python has."""
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            return args[index + 1] if index + 1 < len(args) else STDIN
        if arg == "--check-hash-based-pycs":  # python's one long option that takes a value
            index += 2
            continue
        if arg.startswith("--"):
            return None  # --help, --version and the like run no script; others: not python's
        if not arg.startswith("-") or arg == STDIN:
            return arg
        takes_next = _short_options(arg[1:])
        if takes_next is None:
            return None
        index += 2 if takes_next else 1
    return STDIN


def _short_options(letters: str) -> bool | None:
    """Reads one argument of python's short options (``-uB``, ``-Werror``, ``-W``): True when
    the next argument is an option's value, None when no script follows or an option is
    unknown."""
    for position, letter in enumerate(letters):
        if letter in _PYTHON_VALUE_OPTIONS:
            return position == len(letters) - 1
        if letter not in _PYTHON_FLAGS:
            return None
    return False
