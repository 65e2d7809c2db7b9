"""`python -m plait ...` (and `torchrun ... -m plait train ...`) run the `plait` command."""

import sys

from plait.cli import main


sys.exit(main())
