"""`python -m mesh.agent`: run a node agent (see mesh.node.agent_server)."""
import sys

from mesh.node.agent_server import main

sys.exit(main())
