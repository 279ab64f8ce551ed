"""Prometheus metrics: engine state read at scrape time, latencies observed per request.

The public series are per server and say nothing of any one request: requests running,
waiting, ended and refused, pool size, preemptions, ownership violations, HTTP errors. The
rest is only in the private registry (the --metrics-port listener, or /metrics with an admin
key, or any request on a server without API keys): per-tenant series, and the pages in use,
token and prefix-cache counters and latency histograms, whose steps under light traffic
would give another tenant's prompt length and cache hits."""

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Collector:
    """Series read from the engine at scrape time by `series(engine)`; none before it loads."""

    def __init__(self, get_engine, series):
        self.get_engine, self.series = get_engine, series

    def collect(self):
        engine = self.get_engine()
        return [] if engine is None else self.series(engine)


def _engine_state(engine):
    a, s = engine.allocator, engine.scheduler
    yield GaugeMetricFamily(
        "kvfence_requests_running",
        "Requests in the running batch",
        value=len(s.running),
    )
    yield GaugeMetricFamily(
        "kvfence_requests_waiting",
        "Requests waiting to be scheduled",
        value=len(s.waiting),
    )
    yield GaugeMetricFamily("kvfence_kv_pages_total", "KV pages in the pool", value=a.num_pages)
    yield CounterMetricFamily(
        "kvfence_preemptions",
        "Requests preempted for lack of pages",
        value=s.num_preemptions,
    )
    yield CounterMetricFamily(
        "kvfence_kv_sentinel_violations",
        "Ownership violations caught before a step",
        value=engine.runner.sentinel_violations,
    )
    finished = CounterMetricFamily(
        "kvfence_requests_ended", "Requests ended, by outcome", labels=["outcome"]
    )
    for outcome in ("finished", "aborted", "failed"):
        finished.add_metric([outcome], engine.stats[outcome])
    yield finished
    rejected = CounterMetricFamily(
        "kvfence_requests_rejected",
        "Requests rejected at admission, by reason",
        labels=["reason"],
    )
    for reason, count in sorted(engine.rejected.items()):
        rejected.add_metric([reason], count)
    yield rejected


def _traffic(engine):
    """Pages in use, token and prefix-cache counters: under light traffic their steps give
    one request's prompt length and cache hits, so they are private."""
    a = engine.allocator
    yield GaugeMetricFamily(
        "kvfence_kv_pages_used",
        "KV pages owned by requests or the prefix cache",
        value=a.num_used,
    )
    held = int((a.owner >= 0).sum() + (a.refcount > 0).sum())
    yield GaugeMetricFamily(
        "kvfence_kv_pages_in_use_by_requests",
        "KV pages owned by or referenced by requests",
        value=held,
    )
    # As vLLM's: pages requests hold; cached pages nobody holds are evictable, so free.
    yield GaugeMetricFamily(
        "kvfence_kv_usage_ratio",
        "Fraction of KV pages held by requests",
        value=held / a.num_pages,
    )
    evictable = engine.prefix_cache.num_evictable if engine.prefix_cache else 0
    yield GaugeMetricFamily(
        "kvfence_kv_pages_evictable",
        "Prefix-cache pages no request holds (free on demand)",
        value=evictable,
    )
    stats = engine.stats
    yield CounterMetricFamily(
        "kvfence_prompt_tokens",
        "Prompt tokens of requests that produced output",
        value=stats["prompt_tokens"],
    )
    yield CounterMetricFamily(
        "kvfence_generation_tokens",
        "Generated tokens",
        value=stats["generation_tokens"],
    )
    cache = engine.prefix_cache_stats()
    yield CounterMetricFamily(
        "kvfence_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        value=cache["queried"],
    )
    yield CounterMetricFamily(
        "kvfence_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache",
        value=cache["hits"],
    )


class _FairShareCollector:
    def __init__(self, get_engine):
        self.get_engine = get_engine

    def collect(self):
        engine = self.get_engine()
        family = GaugeMetricFamily(
            "kvfence_tenant_fair_share_counter",
            "Weighted tokens served so far (fair scheduling's counter)",
            labels=["tenant"],
        )
        for tenant, value in sorted((engine.scheduler.counters if engine else {}).items()):
            family.add_metric([tenant], value)
        yield family


class Metrics:
    def __init__(self, get_engine):
        self.registry = CollectorRegistry()  # public: per server only
        self.private = CollectorRegistry()  # the public series and per-tenant ones
        engine_state = _Collector(get_engine, _engine_state)
        self.registry.register(engine_state)
        self.ttft = Histogram(
            "kvfence_time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.private,
        )
        self.itl = Histogram(
            "kvfence_inter_token_latency_seconds",
            "Time between output chunks of a request",
            buckets=LATENCY_BUCKETS,
            registry=self.private,
        )
        self.e2e = Histogram(
            "kvfence_request_latency_seconds",
            "Request latency, end to end",
            buckets=LATENCY_BUCKETS,
            registry=self.private,
        )
        self.http_errors = Counter(
            "kvfence_http_errors",
            "Error responses, by status and code",
            ["status", "code"],
            registry=self.registry,
        )
        # a request's latencies tell its length under light traffic: private, like its tokens
        for collector in (engine_state, self.http_errors):
            self.private.register(collector)
        self.private.register(_Collector(get_engine, _traffic))
        self.private.register(_FairShareCollector(get_engine))
        tenant = dict(labelnames=["tenant"], registry=self.private)
        self.tenant_requests = Counter(
            "kvfence_tenant_requests",
            "Requests ended, by tenant and outcome",
            labelnames=["tenant", "outcome"],
            registry=self.private,
        )
        self.tenant_prompt_tokens = Counter(
            "kvfence_tenant_prompt_tokens", "Prompt tokens, by tenant", **tenant
        )
        self.tenant_generation_tokens = Counter(
            "kvfence_tenant_generation_tokens", "Generated tokens, by tenant", **tenant
        )
        self.tenant_queue = Histogram(
            "kvfence_tenant_queue_time_seconds",
            "Arrival to first scheduled, by tenant",
            buckets=LATENCY_BUCKETS,
            **tenant,
        )
        self.tenant_ttft = Histogram(
            "kvfence_tenant_time_to_first_token_seconds",
            "Arrival to first token in the engine, by tenant",
            buckets=LATENCY_BUCKETS,
            **tenant,
        )

    def observe_finished(self, record: dict) -> None:
        """Counts one finished request (the engine's record of it) for its tenant."""
        tenant = record["tenant"]
        self.tenant_requests.labels(tenant, record["finish_reason"]).inc()
        self.tenant_prompt_tokens.labels(tenant).inc(record["prompt_tokens"])
        self.tenant_generation_tokens.labels(tenant).inc(record["output_tokens"])
        if record["queue_ms"] is not None:
            self.tenant_queue.labels(tenant).observe(record["queue_ms"] / 1000)
        if record["ttft_ms"] is not None:
            self.tenant_ttft.labels(tenant).observe(record["ttft_ms"] / 1000)

    def render(self, private: bool = False) -> bytes:
        return generate_latest(self.private if private else self.registry)

    def serve(self, host: str, port: int) -> None:
        """Serves every series, per-tenant ones too, on a listener of their own (a thread)."""
        start_http_server(port, host, registry=self.private)
