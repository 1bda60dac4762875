"""`python -m tandem`. Ctrl-C is handled from the first line: during the imports (a second or
so) it ends the process with `Interrupted.` and 130, as main() does later, never a traceback."""
import os
import signal


def _interrupted(signum, frame) -> None:  # noqa: ARG001 - a signal handler's signature
    os.write(2, b"Interrupted.\n")
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted)
from tandem.commands.app import main  # noqa: E402 - after the handler, on purpose

signal.signal(signal.SIGINT, signal.default_int_handler)  # main() takes Ctrl-C from here
main()
