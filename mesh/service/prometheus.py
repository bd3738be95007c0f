"""Prometheus metrics of the control service (`GET /metrics`).

Per model (labels tenant, model): requests by outcome, TTFT and TPOT histograms as the
client sees them (from the HTTP request's arrival to the first token event; mean time per
later token), SLO attainment (requests that completed within the model's TTFT and TPOT
SLOs over all requests that reached a node's queue), prompt and generated tokens.
Per node (label node), read from the cluster control's view at scrape time: agent up, restarts,
instances, queue length, running requests, KV bytes in use, memory budget and use, busy
fraction; the weights plane's host copies and bytes received. Per instance (labels node,
instance): the iteration-time factors the agent learnt against the profile, the profile's
drift (largest deviation over grid regions) and the learnt shadow-validation margin. The
cluster dispatcher (`mesh_dispatcher_*`): waiting requests per tenant, placements by node
kind, preemptions, moved requests, evictions rescheduled, new, warm-up and recycled
instances, rejections and failures by reason, the requests of lost nodes by cause (handed
back, resumed, failed: `mesh_dispatcher_lost`, `_resumed`, `_lost_failed`), decisions' durations
(`mesh_dispatcher_decision_seconds`). The service's event-loop lag
(`mesh_event_loop_lag_seconds`, mesh.control.latency). HTTP responses by route and status.

`usage(tenant)` reads one tenant's figures back from the same counters (GET /v1/usage): what
a tenant sees of itself is exactly what the operator scrapes, recorded once. The figures live
in memory: they start at zero when the service starts.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from mesh.control.latency import LogHistogram, export_buckets

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _dispatcher_families(d: dict[str, Any] | None) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The cluster dispatcher's counts (ClusterControl.view()["dispatcher"])."""
    if not d:
        return
    waiting = GaugeMetricFamily("mesh_dispatcher_waiting_requests", "requests in the dispatcher's waiting queue, "
                                "per tenant", labels=["tenant"])
    for tenant, n in sorted(d["waiting_by_tenant"].items()):
        waiting.add_metric([tenant], float(n))
    yield waiting
    placed = CounterMetricFamily("mesh_dispatcher_placements", "requests placed, by the kind of node they "
                                 "first ran on", labels=["kind"])
    for kind, n in sorted(d["placed_by_kind"].items()):
        placed.add_metric([kind], float(n))
    yield placed
    for key, doc in (("preemptions", "instances preempted to make room (LLM-Mesh 7.1)"),
                     ("moved_requests", "running requests moved by preemption, their streams resumed elsewhere"),
                     ("evictions_rescheduled", "requests evicted by a node's memory subsystem (6.4) and placed again"),
                     ("new_instances", "instances the policy started"),
                     ("warm_ups", "instances started for a request their cold start could not serve in time"),
                     ("instances_recycled", "instances unloaded after their keep-alive")):
        c = CounterMetricFamily(f"mesh_dispatcher_{key}", doc)
        c.add_metric([], float(d[key]))
        yield c
    for key, doc in (("rejected", "requests turned away before they ran, by reason"),
                     ("failed", "requests that failed after they were placed, by reason")):
        c = CounterMetricFamily(f"mesh_dispatcher_{key}", doc, labels=["reason"])
        for reason, n in sorted(d[key].items()):
            c.add_metric([reason], float(n))
        yield c
    for key, doc in (("lost", "requests a lost node held (its agent died, froze, left, lost its network; a hung "
                              "engine), handed back with their progress, by cause"),
                     ("resumed", "requests a lost node held, placed again with their progress (their streams go on), "
                                 "by cause"),
                     ("lost_failed", "requests a lost node held that no node took in time, by cause")):
        c = CounterMetricFamily(f"mesh_dispatcher_{key}", doc, labels=["cause"])
        for cause, n in sorted(d.get(key, {}).items()):
            c.add_metric([cause], float(n))
        yield c
    if d.get("decision_times") is not None:
        yield _histogram("mesh_dispatcher_decision_seconds", "placement decisions' durations (node round trips "
                         "included)", d["decision_times"])


def _histogram(name: str, doc: str, snapshot: dict[str, Any]) -> HistogramMetricFamily:
    """A LogHistogram's snapshot (mesh.control.latency) as a Prometheus histogram."""
    return HistogramMetricFamily(name, doc, buckets=export_buckets(snapshot), sum_value=snapshot.get("sum_s", 0.0))


class _ClusterCollector(Collector):
    def __init__(self, view: Callable[[], dict[str, Any]], attainment: Callable[[], dict[tuple[str, str], float]],
                 loop_lag: Callable[[], LogHistogram | None] = lambda: None) -> None:
        self.view = view
        self.attainment = attainment
        self.loop_lag = loop_lag

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        lag = self.loop_lag()
        if lag is not None:
            yield _histogram("mesh_event_loop_lag_seconds", "how late the service's event loop woke a "
                             "periodic probe (mesh.control.latency.LoopLagProbe)", lag.snapshot())
        view = self.view()
        nodes = view.get("nodes", [])
        yield from _dispatcher_families(view.get("dispatcher"))

        def family(name: str, doc: str, value: Callable[[dict], float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["node"])
            for n in nodes:
                g.add_metric([n["node_id"]], float(value(n)))
            return g

        yield family("mesh_node_up", "1 while the node agent is connected", lambda n: n["state"] == "up")
        yield family("mesh_node_restarts", "times the node agent was restarted", lambda n: n["restarts"])
        yield family("mesh_node_instances", "model instances on the node", lambda n: len(n["instances"]))
        yield family("mesh_node_queue_length", "requests waiting for admission or prefill on the node",
                     lambda n: n["queue_length"])
        yield family("mesh_node_running_requests", "requests admitted on the node", lambda n: n["running"])
        yield family("mesh_node_kv_bytes_in_use", "KV cache bytes held by running requests",
                     lambda n: n["kv_bytes_in_use"])
        yield family("mesh_node_kv_bytes_budget", "KV cache bytes the memory subsystem granted the instances",
                     lambda n: sum(i["kv_bytes_budget"] for i in n["instances"]))
        yield family("mesh_node_memory_capacity_bytes", "the node's memory budget for weights and KV",
                     lambda n: n["memory"].get("capacity_bytes", 0))
        yield family("mesh_node_memory_used_bytes", "memory the node's instances hold (optimistic budget)",
                     lambda n: n["memory"].get("budget_bytes", 0))
        yield family("mesh_node_busy_fraction", "fraction of the last second the node spent in iterations",
                     lambda n: n["busy_fraction"])
        # A profile's drift (mesh.perf.times.AdaptiveTimes.drift): how far the node's real
        # iteration times are from its profile, per instance.
        factor = GaugeMetricFamily("mesh_instance_time_factor", "real over profiled iteration time the agent "
                                   "learnt for the instance (1: the profile holds)", labels=["node", "instance",
                                                                                             "kind"])
        drift = GaugeMetricFamily("mesh_instance_profile_drift", "largest |factor - 1| over the instance's "
                                  "learnt grid regions", labels=["node", "instance"])
        margin = GaugeMetricFamily("mesh_instance_margin", "margin shadow validation applies to the instance "
                                   "(learnt from live/predicted; absent until learnt)", labels=["node", "instance"])
        for n in nodes:
            for i in n["instances"]:
                tf = i.get("time_factors") or {}
                labels = [n["node_id"], i["instance_id"]]
                for kind in ("prefill", "decode"):
                    if tf.get(kind) is not None:
                        factor.add_metric(labels + [kind], float(tf[kind]))
                if tf.get("max_drift") is not None:
                    drift.add_metric(labels, float(tf["max_drift"]))
                if tf.get("margin") is not None:
                    margin.add_metric(labels, float(tf["margin"]))
        yield factor
        yield drift
        yield margin
        models = (view.get("weights") or {}).get("models", {}).values()
        copies = GaugeMetricFamily("mesh_node_weights_host_copies", "models whose weights the node holds "
                                   "(parameter pool host copies)", labels=["node"])
        received = GaugeMetricFamily("mesh_node_weights_received_bytes", "model bytes the node received by "
                                     "multicast (weights plane)", labels=["node"])
        for n in nodes:
            node = n["node_id"]
            copies.add_metric([node], float(sum(node in m["host_copies"] for m in models)))
            received.add_metric([node], float(sum(t["bytes"] for m in models for t in m["transfers"]
                                                  if node in t["completed"])))
        yield copies
        yield received
        att = GaugeMetricFamily("mesh_slo_attainment", "fraction of placed requests that met their SLO",
                                labels=["tenant", "model"])
        for (tenant, model), value in sorted(self.attainment().items()):
            att.add_metric([tenant, model], value)
        yield att


class ServiceMetrics:
    def __init__(self, view: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        labels = ["tenant", "model"]
        self.requests = Counter("mesh_requests", "generation requests by outcome "
                                "(completed, rejected, failed, aborted, invalid)", labels + ["outcome"],
                                registry=self.registry)
        self.ttft = Histogram("mesh_ttft_seconds", "time to first token, from request arrival", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("mesh_tpot_seconds", "mean time per output token after the first", labels,
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.slo_met = Counter("mesh_slo_met", "requests completed within their TTFT and TPOT SLOs", labels,
                               registry=self.registry)
        self.prompt_tokens = Counter("mesh_prompt_tokens", "prompt tokens of placed requests", labels,
                                     registry=self.registry)
        self.generated_tokens = Counter("mesh_generated_tokens", "tokens generated", labels, registry=self.registry)
        self.http = Counter("mesh_http_responses", "HTTP responses by route and status", ["route", "status"],
                            registry=self.registry)
        self._slo: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # (met, placed)
        self.loop_lag: LogHistogram | None = None  # the service's event-loop lag probe's, once it runs
        self.registry.register(_ClusterCollector(view, self._attainment, lambda: self.loop_lag))

    def _attainment(self) -> dict[tuple[str, str], float]:
        return {k: met / placed for k, (met, placed) in self._slo.items() if placed}

    def request_done(self, tenant: str, model: str, outcome: str, *, prompt_tokens: int = 0, tokens_out: int = 0,
                     ttft_s: float | None = None, tpot_s: float | None = None, slo_met: bool = False,
                     placed: bool = False) -> None:
        """Record one generation request's end. `placed`: it reached a node's admission queue
        (rejections with 429 count against SLO attainment; invalid requests do not)."""
        self.requests.labels(tenant, model, outcome).inc()
        if prompt_tokens:
            self.prompt_tokens.labels(tenant, model).inc(prompt_tokens)
        if tokens_out:
            self.generated_tokens.labels(tenant, model).inc(tokens_out)
        if ttft_s is not None:
            self.ttft.labels(tenant, model).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(tenant, model).observe(tpot_s)
        if placed:
            entry = self._slo[(tenant, model)]
            entry[1] += 1
            if slo_met:
                entry[0] += 1
                self.slo_met.labels(tenant, model).inc()

    def forget_model(self, tenant: str, model: str) -> None:
        """A deleted model's series go (a service that runs for months registers and deletes
        models without end): every (tenant, model) series, each outcome's included."""
        for metric in (self.ttft, self.tpot, self.slo_met, self.prompt_tokens, self.generated_tokens):
            try:
                metric.remove(tenant, model)
            except KeyError:
                pass
        for labels in [k for k in self.requests._metrics if k[:2] == (tenant, model)]:  # noqa: SLF001 - its outcomes
            self.requests.remove(*labels)
        self._slo.pop((tenant, model), None)

    def usage(self, tenant: str) -> list[dict[str, Any]]:
        """Per model of `tenant`: requests by outcome, tokens, TTFT and TPOT means, SLO attainment."""
        out: dict[str, dict[str, Any]] = {}

        def entry(model: str) -> dict[str, Any]:
            return out.setdefault(model, {"model": model, "requests": {}, "prompt_tokens": 0, "completion_tokens": 0,
                                          "ttft_s_mean": None, "tpot_s_mean": None,
                                          "slo": {"met": 0, "placed": 0, "attainment": None}})

        for metric, key in ((self.requests, None), (self.prompt_tokens, "prompt_tokens"),
                            (self.generated_tokens, "completion_tokens")):
            for family in metric.collect():
                for sample in family.samples:
                    if sample.labels.get("tenant") != tenant or not sample.name.endswith("_total"):
                        continue
                    e = entry(sample.labels["model"])
                    if key is None:
                        e["requests"][sample.labels["outcome"]] = int(sample.value)
                    else:
                        e[key] = int(sample.value)
        for metric, key in ((self.ttft, "ttft_s_mean"), (self.tpot, "tpot_s_mean")):
            sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for family in metric.collect():
                for sample in family.samples:
                    if sample.labels.get("tenant") == tenant and sample.name.endswith(("_sum", "_count")):
                        sums[sample.labels["model"]][sample.name.endswith("_count")] += sample.value
            for model, (total, count) in sums.items():
                if count:
                    entry(model)[key] = total / count
        for (t, model), (met, placed) in self._slo.items():
            if t == tenant:
                entry(model)["slo"] = {"met": met, "placed": placed, "attainment": met / placed if placed else None}
        for e in out.values():
            e["requests"]["total"] = sum(e["requests"].values())
        return [out[m] for m in sorted(out)]

    def render(self) -> bytes:
        return generate_latest(self.registry)
