"""`python -m mesh` is the `mesh` command."""
import sys

from mesh.cli import main

sys.exit(main())
