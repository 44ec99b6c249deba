"""``python -m acl_lab``: see :mod:`acl_lab.cli`."""
import sys

from .cli import main
from .distributed import shutdown

code = main()
if code == 0:  # under torchrun the ranks leave the process group together, so none is aborted at exit
    shutdown()
sys.exit(code)
