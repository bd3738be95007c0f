"""Node agents: one process per node runs its NodeRuntime and engines; the control service
talks to it over a connection (mesh.agent.protocol), the same way on this machine or another.

- mesh.agent.protocol: frames and messages;
- mesh.agent.server: the agent process (`python -m mesh.agent`);
- mesh.agent.engines: which engine serves an instance on which node kind, and its iteration
  times;
- mesh.agent.client: the control service's proxy of one agent connection;
- mesh.agent.supervisor: spawns a local agent process and restarts it when it dies.
"""
