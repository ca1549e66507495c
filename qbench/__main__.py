import sys

from qbench.cli import main

sys.exit(main())
