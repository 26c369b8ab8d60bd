"""``python -m epp.cli``: the ``epp`` command."""

import sys

from epp.cli import main

sys.exit(main())
