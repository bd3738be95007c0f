"""Tenant quotas at run time: each tenant's effective quota (the config's defaults with the
operator's settings from the registry on top), its open requests and its token bucket.
The rules are mesh.policy.quota's; time is the event loop's, passed in by the caller.

Generation requests are checked in the HTTP layer around `ClusterControl.submit`
(mesh.service.routes_openai): over `concurrent_requests` or `requests_per_s` they get 429 with
Retry-After. Registrations are checked before the model is stored (routes_models): over
`registrations_per_min` 429 with Retry-After, over `models` 403, over `model_bytes` 413. A
tenant's registered bytes are the sum of its models' weight bytes, which is what their first
host copies hold on the nodes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from mesh.policy.quota import (
    MODEL_BYTES,
    REGISTRATION_BURST,
    Over,
    Quota,
    TokenBucket,
    concurrency_over,
    rate_over,
    registration_over,
    registration_rate_over,
)
from mesh.service import errors
from mesh.service.registry import Registry


class Quotas:
    def __init__(self, registry: Registry, defaults: Quota) -> None:
        self.registry = registry
        self.defaults = defaults
        self.open: dict[str, int] = defaultdict(int)  # tenant -> generation requests open now
        self._buckets: dict[str, TokenBucket] = {}
        self._registration_buckets: dict[str, TokenBucket] = {}

    def of(self, tenant: str) -> Quota:
        return self.defaults.with_overrides(self.registry.quota_settings(tenant))

    def changed(self, tenant: str) -> None:
        """The operator set new quotas: the tenant's bucket starts again, full, at the new rate."""
        self._buckets.pop(tenant, None)
        self._registration_buckets.pop(tenant, None)

    def check_registration(self, tenant: str, new_bytes: int) -> None:
        models, used = self.registry.usage(tenant)
        over = registration_over(self.of(tenant), models, used, new_bytes)
        if over is not None:
            raise errors.over_quota(over.quota, over.message(), 413 if over.quota == MODEL_BYTES else 403)

    def take_registration(self, tenant: str, now_s: float) -> None:
        """One registration of `tenant` from its bucket; 429 with Retry-After when it is empty."""
        quota = self.of(tenant)
        bucket = None
        if quota.registrations_per_min is not None:
            rate = quota.registrations_per_min / 60.0
            bucket = self._registration_buckets.get(tenant)
            if bucket is None or bucket.rate != rate:
                bucket = self._registration_buckets[tenant] = TokenBucket.full(rate, REGISTRATION_BURST, now_s)
        over = registration_rate_over(quota, bucket, now_s)
        if over is not None:
            raise self._too_many(over)

    def upload_over(self, tenant: str, quota_bytes: int, used: int) -> errors.ApiError:
        """The 413 for an upload larger than what is left of the tenant's `model_bytes`."""
        left = max(0, quota_bytes - used)
        return errors.over_quota(MODEL_BYTES, f"This upload is larger than the {left} bytes ({left / 2**30:.2f} GiB) "
                                 f"left of your quota '{MODEL_BYTES}' ({quota_bytes} bytes, {used} in use).", 413)

    def acquire(self, tenant: str, now_s: float, count: int = 1) -> None:
        """Open `count` generation requests for `tenant` (a request's n choices count n; release
        them with `release`); 429 naming the quota when it is over. A request refused for
        concurrency takes no token from the bucket; one refused for rate keeps those it took."""
        quota = self.of(tenant)
        over = concurrency_over(quota, self.open[tenant] + count - 1)
        bucket = self._bucket(tenant, quota, now_s)
        for _ in range(count):
            over = over or rate_over(quota, bucket, now_s)
        if over is not None:
            raise self._too_many(over)
        self.open[tenant] += count

    def release(self, tenant: str, count: int = 1) -> None:
        self.open[tenant] -= count
        if self.open[tenant] <= 0:
            del self.open[tenant]

    def view(self, tenant: str) -> dict[str, Any]:
        models, used = self.registry.usage(tenant)
        return {"tenant": tenant, "quota": self.of(tenant).as_dict(), "settings": self.registry.quota_settings(tenant),
                "defaults": self.defaults.as_dict(),
                "usage": {"models": models, "model_bytes": used, "concurrent_requests": self.open.get(tenant, 0)}}

    def _bucket(self, tenant: str, quota: Quota, now_s: float) -> TokenBucket | None:
        if quota.requests_per_s is None:
            return None
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.rate != quota.requests_per_s or bucket.size != quota.bucket_size:
            bucket = self._buckets[tenant] = TokenBucket.full(quota.requests_per_s, quota.bucket_size, now_s)
        return bucket

    @staticmethod
    def _too_many(over: Over) -> errors.ApiError:
        return errors.over_quota(over.quota, over.message(), 429, over.retry_after_s)
