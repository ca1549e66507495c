import sys

from qbench.cli import main  # qbench/__init__.py and qbench.cli turn a Ctrl-C while importing into one line

sys.exit(main())
