"""The policy core: everything Mesh decides, as plain functions and objects.

No I/O and no clock: every decision takes `now` (seconds, from whatever clock the caller
runs on) and state, and returns a decision.
"""
