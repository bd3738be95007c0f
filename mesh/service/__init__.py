"""The control service (`mesh serve`): REST for tenants and operators, OpenAI-compatible serving,
a SQLite registry, metrics, and placement of requests on node agents. See docs/service.md."""
