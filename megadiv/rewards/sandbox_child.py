"""Entry point of the sandbox's child side: ``python -S -B -P sandbox_child.py RESULTS_FD CONTROL_FD``.

The child side is the ``jail`` package next to this file (standard library only, never imports
megadiv: it runs before any isolation exists); see ``jail/runner.py`` for the process tree.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jail.runner import main  # noqa: E402  (the path above first)

del sys.path[0]  # the program's imports do not see megadiv's modules

if __name__ == "__main__":
    sys.exit(main())
