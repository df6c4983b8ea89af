"""`python -m exactness ARGS` run through its main in this process, for the tests: a new Python
costs 2-5 s. Each test module that uses it still runs its command once as a real process."""

from __future__ import annotations

import subprocess


def main_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The exit code and what the command printed. A traceback would be an exception here, and
    fail the test."""
    from exactness.__main__ import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's refusals
        code = e.code
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, printed.out, printed.err)
