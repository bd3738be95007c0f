"""The HTTP connection bounds' defaults and the open-file limit the service raises to hold them
(mesh.service.limits; the hostile-client attacks themselves are in tests/test_hostile.py)."""
from __future__ import annotations

import resource

from mesh.service.config import ServeConfig
from mesh.service.limits import FD_RESERVE, HttpLimits


def test_the_service_raises_its_open_file_limit_to_hold_its_connections():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))  # a small default, as on many machines
        limits = HttpLimits(max_connections=1000)
        got = limits.fit_fd_limit()
        assert got == min(1000 + FD_RESERVE, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert HttpLimits(max_connections=10).fit_fd_limit() == got  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_one_address_may_hold_a_load_generators_streams():
    """A proxy or `mesh replay --live` holds a stream per waiting request from one address:
    the default per-address bound must leave room for hundreds (64 lost requests in a run)."""
    c = ServeConfig()
    assert c.max_connections_per_client == HttpLimits().max_connections_per_client >= 512
    assert c.max_connections == HttpLimits().max_connections > c.max_connections_per_client
