"""``python -m mixlab``: :func:`mixlab.cli.main`. A Ctrl-C while the libraries are still being imported (the first
seconds) ends in one line and exit status 130, as it does later, not in an import traceback."""

import os
import signal
import sys

if __name__ == "__main__":
    try:
        from mixlab.cli import main
    except KeyboardInterrupt:
        if os.environ.get("MIXLAB_TRACEBACK"):
            raise
        print("mixlab: interrupted (Ctrl-C) while starting", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    main()
