"""Run under torchrun by tests/test_distributed.py: several ``python -m acl_lab train`` command lines in one launch.

``argv[1]`` is a JSON list of argument lists; each goes through :func:`acl_lab.cli.main`, the function
behind ``python -m acl_lab``, so one process-group start-up serves several runs.
"""
import json
import sys

from acl_lab.cli import main
from acl_lab.distributed import shutdown

if __name__ == "__main__":
    for argv in json.loads(sys.argv[1]):
        code = main(argv)
        if code:
            sys.exit(code)
    shutdown()  # the ranks leave the process group together (see acl_lab.distributed.shutdown)
