"""`python -m mesh.agent`: run a node agent (see mesh.agent.server)."""
import sys

from mesh.agent.server import main

sys.exit(main())
