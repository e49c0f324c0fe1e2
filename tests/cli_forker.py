"""A warm process that runs `eagle31-export` commands in forked children, so that a test can
SIGKILL a real command at chosen moments without paying for the interpreter and torch start-up
on every run (on 2 cores that start-up is several times the commands' own work).

Each child is a separate process running the console script's entry point
(`eagle31_export.cli.main:main`) with its own argv; it is killed with SIGKILL, which no code can
intercept, exactly like `kill -9` on `eagle31-export`.

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout.
    {"op": "warm", "argv": [...]}                  run in this process (imports everything the
                                                   command needs, so children start warm)
                                                   -> {"code": int, "seconds": float}
    {"op": "run", "argv": [...], "log": PATH, "kill_after": seconds | null}
        -> {"killed": bool, "code": int | null, "seconds": float}
`killed` is false when the child exited before `kill_after`; its exit code is then in `code`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _run_cli(argv: list[str]) -> int:
    from eagle31_export.cli.main import main

    sys.argv = ["eagle31-export", *argv]
    try:
        main()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as a failed run
        import traceback

        traceback.print_exc()
        return 99
    return 0


def _child(argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 99
    try:
        code = _run_cli(argv)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run(argv: list[str], log: str, kill_after: float | None) -> dict:
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(argv, log)
    deadline = None if kill_after is None else start + kill_after
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"killed": False, "code": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - start}
        if deadline is not None and time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            # a child that finished in the instant before the signal was not killed
            return {"killed": code == -signal.SIGKILL, "code": None if code == -signal.SIGKILL else code,
                    "seconds": time.monotonic() - start}
        time.sleep(0.001)


def main() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open(sys.argv[1] if len(sys.argv) > 1 else os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)  # what warm runs print stays out of the answers
    os.dup2(log, 2)
    import torch

    torch.set_num_threads(1)  # tiny models; and no thread pool exists when children are forked
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "warm":
            start = time.monotonic()
            code = _run_cli(request["argv"])
            answer = {"code": code, "seconds": time.monotonic() - start}
        else:
            answer = _run(request["argv"], request["log"], request.get("kill_after"))
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
