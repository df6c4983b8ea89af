"""The fork server of the C kernels' first runs (first_run.py), run by its path as a child Python.

A fresh Python for each first run imports torch again: 2 s a run, and a cold `make verify`
makes about 40 of them (a build of each planted bug). This server imports torch (and numpy)
once, runs no operation of theirs (so no thread pool of theirs exists to be forked half-way),
and forks a child for each first run. The child sets the request's environment and working
directory, then imports exactness itself, as a fresh Python would: nothing of exactness is
imported here, since what its modules read at import must come from the request. A child that
dies of a signal or hangs harms only itself: the server reports it and goes on.

One JSON line each way a run, on stdin and stdout. Request: {"argv", "env", "cwd", "seconds"}.
Reply: {"returncode" (negative: the signal that ended it), "stdout", "stderr", "timed_out"}.
The server ends when its stdin closes (the process that started it is gone).
"""

import json
import os
import select
import signal
import sys
import time

POLL = 0.01  # seconds between looks at a child that closed its output but has not ended


def child(request: dict, out: int, err: int) -> None:
    """In the forked child: the first run's main, with its output on the pipes; never returns."""
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from exactness.kernels.first_run import main

        code = main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on stderr, as a fresh Python would
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - the exit below must happen
                pass
        os._exit(code)


def run(request: dict) -> dict:
    """Fork a child for one first run and wait for it, at most request["seconds"]."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_read)
        os.close(err_read)
        child(request, out_write, err_write)
    os.close(out_write)
    os.close(err_write)
    deadline = time.monotonic() + float(request["seconds"])
    output = {out_read: bytearray(), err_read: bytearray()}
    reading, status = [out_read, err_read], None
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if reading:
            for fd in select.select(reading, [], [], left)[0]:
                data = os.read(fd, 1 << 16)
                output[fd].extend(data)
                if not data:
                    reading.remove(fd)
            continue
        done, status_now = os.waitpid(pid, os.WNOHANG)
        if done:
            status = status_now
        else:
            time.sleep(POLL)
    timed_out = status is None
    if timed_out:
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    for fd in output:
        os.close(fd)
    returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return {"returncode": returncode, "stdout": output[out_read].decode(errors="replace"),
            "stderr": output[err_read].decode(errors="replace"), "timed_out": timed_out}


def serve() -> int:
    import numpy  # noqa: F401 - what every child would import again
    import torch  # noqa: F401

    for line in sys.stdin:
        sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":  # run by path with -P: its folder (which holds a `triton`) not on
    sys.exit(serve())  # sys.path, so it shadows no package of the same name
