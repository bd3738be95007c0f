"""What crosses between processes: the node agent protocol's typed messages, and the request
record the control service hands a node."""
