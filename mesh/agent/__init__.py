"""`python -m mesh.agent`: the node agent command. The agent itself is mesh.node.agent_server;
what crosses its connection is mesh.wire.agent_protocol; the control side of that connection
is mesh.control.agent_client and mesh.control.supervisor."""
