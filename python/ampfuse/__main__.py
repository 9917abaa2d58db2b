"""`python -m ampfuse COMMAND`: the command line lives in ampfuse.tools.cli."""

import sys

from ampfuse.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
