"""``python -m mixlab``: :func:`mixlab.cli.main`. A Ctrl-C while the libraries are still being imported (the first
seconds) ends in one line and exit status 130, as it does later, not in an import traceback; a SIGTERM then ends in
one line and exit status 143 (it was the default action: no word)."""

import os
import signal
import sys

if __name__ == "__main__":  # SIGTERM while starting: mixlab/__init__.py's handler, until mixlab.cli.main's
    try:
        from mixlab.cli import main
    except KeyboardInterrupt:
        if os.environ.get("MIXLAB_TRACEBACK"):
            raise
        print("mixlab: interrupted (Ctrl-C) while starting", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    main()
    # done: a Ctrl-C or SIGTERM while the interpreter exits (joining loader workers, finalizing) ends it at once,
    # quietly (the early SIGTERM handler restored by main would say "while starting")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
