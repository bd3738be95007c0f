"""Tenant quotas: the rules, without I/O or a clock (the caller passes the time).

A quota caps one tenant: how many models it registers (`models`), the bytes of their weights
(`model_bytes`: each registration pins a first host copy of that size on a node, BlitzScale
5.3, so a tenant's registered bytes are what it holds of the nodes' host memory), how many of
its generation requests are open at once (`concurrent_requests`) and how fast it may send
them (`requests_per_s`, a token bucket of `burst` requests), and how fast it registers
models (`registrations_per_min`, a token bucket of `REGISTRATION_BURST`: each registration
starts a weights copy, a describe call and a build ahead; finite by default). None
means no limit.

`TokenBucket` is the classic one: it holds up to `burst` tokens, refills at `rate` per second
and a request takes one; `take(now_s)` says how long to wait when it is empty.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

# The quota names as the API and the errors spell them.
MODELS = "models"
MODEL_BYTES = "model_bytes"
CONCURRENT = "concurrent_requests"
RATE = "requests_per_s"
BURST = "burst"
REGISTRATIONS = "registrations_per_min"
DEFAULT_REGISTRATIONS_PER_MIN = 30.0
REGISTRATION_BURST = 10  # registrations a tenant may make at once, before the rate applies


@dataclass(frozen=True, slots=True)
class Quota:
    models: int | None = None
    model_bytes: int | None = None
    concurrent_requests: int | None = None
    requests_per_s: float | None = None
    burst: int | None = None  # None: one second's worth of requests_per_s (at least 1)
    registrations_per_min: float | None = DEFAULT_REGISTRATIONS_PER_MIN

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Quota":
        """This quota (the defaults) with a tenant's settings on top (a None there: no limit)."""
        return replace(self, **{k: v for k, v in overrides.items() if k in QUOTA_FIELDS})

    @property
    def bucket_size(self) -> float:
        if self.requests_per_s is None:
            return math.inf
        return float(self.burst) if self.burst is not None else max(1.0, self.requests_per_s)

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in QUOTA_FIELDS}


QUOTA_FIELDS = tuple(f.name for f in fields(Quota))


class QuotaValueError(ValueError):
    """A quota setting is not a valid value; the message names it."""


def check_overrides(data: Mapping[str, Any]) -> dict[str, Any]:
    """A tenant's quota settings, checked: known names, non-negative integers (a positive
    number for requests_per_s, a positive integer for burst), or None for no limit."""
    unknown = sorted(set(data) - set(QUOTA_FIELDS))
    if unknown:
        raise QuotaValueError(f"unknown quota {', '.join(unknown)}; the quotas are {', '.join(QUOTA_FIELDS)}")
    out: dict[str, Any] = {}
    for name, value in data.items():
        if value is None:
            out[name] = None
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if name in (RATE, REGISTRATIONS):
            if not number or value <= 0:
                raise QuotaValueError(f"'{name}' must be a positive number (or null for no limit)")
            out[name] = float(value)
            continue
        integral = number and float(value).is_integer()
        low = 1 if name == BURST else 0
        if not integral or value < low:
            raise QuotaValueError(f"'{name}' must be an integer of at least {low} (or null for no limit)")
        out[name] = int(value)
    return out


@dataclass(frozen=True, slots=True)
class Over:
    """Why something is over quota: which quota, its limit, and what the tenant has or asks."""

    quota: str
    limit: float
    used: float
    retry_after_s: float = 0.0

    def message(self) -> str:
        if self.quota == MODELS:
            return f"You have {self.used:.0f} models; your quota '{MODELS}' allows {self.limit:.0f}."
        if self.quota == MODEL_BYTES:
            return (f"Registering this model would bring your models to {self.used:.0f} bytes "
                    f"({self.used / 2**30:.2f} GiB); your quota '{MODEL_BYTES}' allows {self.limit:.0f} bytes "
                    f"({self.limit / 2**30:.2f} GiB).")
        if self.quota == CONCURRENT:
            return f"You have {self.used:.0f} requests open; your quota '{CONCURRENT}' allows {self.limit:.0f}."
        if self.quota == REGISTRATIONS:
            return (f"Your quota '{REGISTRATIONS}' allows {self.limit:g} model registrations per minute; retry in "
                    f"{self.retry_after_s:.2f} s.")
        return f"Your quota '{RATE}' allows {self.limit:g} requests per second; retry in {self.retry_after_s:.2f} s."


def registration_over(quota: Quota, models: int, model_bytes: int, new_bytes: int) -> Over | None:
    """May a tenant with `models` models of `model_bytes` bytes register one of `new_bytes`?"""
    if quota.models is not None and models + 1 > quota.models:
        return Over(MODELS, quota.models, models)
    if quota.model_bytes is not None and model_bytes + new_bytes > quota.model_bytes:
        return Over(MODEL_BYTES, quota.model_bytes, model_bytes + new_bytes)
    return None


def concurrency_over(quota: Quota, open_requests: int) -> Over | None:
    """May a tenant with `open_requests` open requests open one more?"""
    if quota.concurrent_requests is not None and open_requests + 1 > quota.concurrent_requests:
        return Over(CONCURRENT, quota.concurrent_requests, open_requests, 1.0)
    return None


@dataclass(slots=True)
class TokenBucket:
    rate: float  # tokens per second
    size: float  # most tokens it holds (the burst)
    tokens: float
    updated_s: float

    @classmethod
    def full(cls, rate: float, size: float, now_s: float) -> "TokenBucket":
        return cls(rate, size, size, now_s)

    def take(self, now_s: float) -> float:
        """Take one token: 0.0 when there was one, else the seconds until there is (nothing taken)."""
        self.tokens = min(self.size, self.tokens + max(0.0, now_s - self.updated_s) * self.rate)
        self.updated_s = max(self.updated_s, now_s)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def rate_over(quota: Quota, bucket: TokenBucket | None, now_s: float) -> Over | None:
    """Take a request from the tenant's bucket (None: no rate quota); Over when it is empty."""
    return _bucket_over(RATE, quota.requests_per_s, bucket, now_s)


def registration_rate_over(quota: Quota, bucket: TokenBucket | None, now_s: float) -> Over | None:
    """Take a registration from the tenant's registration bucket (None: no limit); Over when
    it is empty."""
    return _bucket_over(REGISTRATIONS, quota.registrations_per_min, bucket, now_s)


def _bucket_over(name: str, limit: float | None, bucket: TokenBucket | None, now_s: float) -> Over | None:
    if limit is None or bucket is None:
        return None
    wait = bucket.take(now_s)
    if wait > 0:
        return Over(name, limit, limit, wait)
    return None
