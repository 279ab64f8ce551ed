"""Prometheus metrics: engine state read at scrape time, latencies observed per request."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    def __init__(self, get_engine):
        self.get_engine = get_engine

    def collect(self):
        engine = self.get_engine()
        if engine is None:
            return
        a, s = engine.allocator, engine.scheduler
        yield GaugeMetricFamily("kvfence_requests_running", "Requests in the running batch", value=len(s.running))
        yield GaugeMetricFamily("kvfence_requests_waiting", "Requests waiting to be scheduled", value=len(s.waiting))
        yield GaugeMetricFamily("kvfence_kv_pages_total", "KV pages in the pool", value=a.num_pages)
        yield GaugeMetricFamily("kvfence_kv_pages_used", "KV pages owned by requests or the prefix cache",
                                value=a.num_used)
        yield GaugeMetricFamily("kvfence_kv_pages_in_use_by_requests", "KV pages owned by or referenced by requests",
                                value=int((a.owner >= 0).sum() + (a.refcount > 0).sum()))
        yield GaugeMetricFamily("kvfence_kv_usage_ratio", "Fraction of KV pages in use", value=a.num_used / a.num_pages)
        stats = engine.stats
        yield CounterMetricFamily("kvfence_prompt_tokens", "Prompt tokens of requests that produced output",
                                  value=stats["prompt_tokens"])
        yield CounterMetricFamily("kvfence_generation_tokens", "Generated tokens", value=stats["generation_tokens"])
        yield CounterMetricFamily("kvfence_preemptions", "Requests preempted for lack of pages",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("kvfence_kv_sentinel_violations", "Ownership violations caught before a step",
                                  value=engine.runner.sentinel_violations)
        finished = CounterMetricFamily("kvfence_requests_ended", "Requests ended, by outcome", labels=["outcome"])
        for outcome in ("finished", "aborted", "failed"):
            finished.add_metric([outcome], stats[outcome])
        yield finished
        rejected = CounterMetricFamily("kvfence_requests_rejected", "Requests rejected at admission, by reason",
                                       labels=["reason"])
        for reason, count in sorted(engine.rejected.items()):
            rejected.add_metric([reason], count)
        yield rejected
        cache = engine.prefix_cache_stats()
        yield CounterMetricFamily("kvfence_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=cache["queried"])
        yield CounterMetricFamily("kvfence_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=cache["hits"])


class Metrics:
    def __init__(self, get_engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(get_engine))
        self.ttft = Histogram("kvfence_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("kvfence_inter_token_latency_seconds", "Time between output chunks of a request",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvfence_request_latency_seconds", "Request latency, end to end",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.http_errors = Counter("kvfence_http_errors", "Error responses, by status and code",
                                   ["status", "code"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
