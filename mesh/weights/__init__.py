"""Weights by network (BlitzScale 5.1/5.3, lambdaScale 4.2): a model packed into contiguous
blocks with a manifest (`blocks`), the messages (`protocol`, framed by mesh.framing), the node agent that
sends, forwards and receives blocks over TCP with asyncio streams (`peer`), the control side
that runs a multicast plan across agents and re-plans around failed nodes (`coordinator`),
a launcher for weight agent processes on one machine (`launch`), and a node agent's side:
where received models go and how the service sends a model to nodes (`node`). Plans come from
mesh.policy.multicast; docs/multicast.md describes the protocol.
"""
