"""`python -m silverrec ...` (and `torchrun -m silverrec serve DIR --sharded`): the `silverrec` command."""

import sys

from silverrec.cli import main

if __name__ == "__main__":
    sys.exit(main())
