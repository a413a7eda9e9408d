"""`python -m conveyor.cli ...` runs the `conveyor` command."""

import sys

from conveyor.cli import main

sys.exit(main())
