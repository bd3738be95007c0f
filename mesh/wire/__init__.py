"""What crosses between processes: the node agent protocol's typed messages."""
