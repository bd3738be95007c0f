"""Weights by network (BlitzScale 5.1/5.3, lambdaScale 4.2): a model packed into contiguous
blocks with a manifest (`blocks`), the messages (`protocol`, framed by mesh.framing), the node agent that
sends, forwards and receives blocks over TCP with asyncio streams (`agent`), the control side
that runs a multicast plan across agents and re-plans around failed nodes (`coordinator`),
and a launcher for agent processes on one machine (`launch`). Plans come from
mesh.policy.multicast; docs/multicast.md describes the protocol.
"""
