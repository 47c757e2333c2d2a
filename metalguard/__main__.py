"""``python -m metalguard``: the same as the ``metalguard`` command."""

import sys

from metalguard.cli import main

sys.exit(main())
