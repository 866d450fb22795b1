"""``python -m megadiv.cli VERB ...``: the entry torchrun runs on every rank (megadiv.cli.launch)."""
import sys

from megadiv.cli import main

sys.exit(main())
