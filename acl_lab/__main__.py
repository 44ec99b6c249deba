"""``python -m acl_lab``: see :mod:`acl_lab.cli`."""
import sys

from .cli import main

sys.exit(main())
