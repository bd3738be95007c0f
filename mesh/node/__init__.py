"""What runs in a node agent process: the token-level loop (NodeRuntime), the agent server,
engine hosts, tokenizers and builds ahead."""
