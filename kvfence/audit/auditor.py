"""Black-box isolation and consistency audit of any OpenAI-compatible server.

Checks, in order: canary leaks between concurrent requests and tenants, the context and
pool boundaries, greedy consistency alone versus under load, prompts resent after a client
dropped them mid-prefill, a prefix cache shared across keys (cache_probe.py), and timing and
token accounting. Every response of every phase is finally scanned for other requests'
secrets. Given a deployment's worker URLs, it first checks that their internal endpoints
refuse clients (workers.py).
"""

import asyncio
import itertools
import random
import string
import time

import httpx
from tqdm import tqdm

from kvfence.audit import CHECKS
from kvfence.audit.cache_probe import MAX_WORDS, CacheProbe, CacheTest, ProbeError
from kvfence.audit.client import AuditClient, Exchange
from kvfence.audit.prompts import (
    CANARY_PHRASE,
    CANARY_TEMPLATE,
    CONSISTENCY_PROMPTS,
    FILLER_TOPICS,
    PROBE_PROMPTS,
    join,
    random_words,
)
from kvfence.audit.report import Finding, Report
from kvfence.audit.workers import probe_workers

ABORT_TRIALS = 3
ABORT_TOKENS = 1024  # long enough for a server to prefill in several chunks


class AuditError(Exception):
    """The audit could not run (server unreachable, no model, bad key)."""


class Auditor:
    def __init__(
        self,
        base_url: str | None,
        api_keys: list[str] | None = None,
        model: str | None = None,
        max_model_len: int | None = None,
        pool_tokens: int | None = None,
        canaries: int = 24,
        concurrency: int = 16,
        timeout: float = 300,
        progress: bool = True,
        seed: int | None = None,
        workers: list[str] | None = None,
        checks: tuple[str, ...] = CHECKS,
        budget_minutes: float = 10.0,
        alpha: float = 0.01,
        cache_min_tokens: int = 1024,
    ):
        self.base = base_url.rstrip("/") if base_url else None
        self.workers = list(workers or [])
        self.keys = list(api_keys or []) or [None]
        self.report = Report(self.base or "", model or "", max_model_len, pool_tokens)
        self.client = AuditClient(self.base or "", self.keys, concurrency, timeout)
        self.canaries = canaries
        self.rng = random.Random(seed)
        self.progress = progress
        self.checks = checks
        self.budget_s = 60 * budget_minutes
        self.alpha = alpha
        self.cache_min_tokens = cache_min_tokens
        self.started = time.monotonic()

    def find(self, check: str, message: str, **detail) -> None:
        self.report.findings.append(Finding(check, message, detail))

    def exchanges(self, *phases: str) -> list[Exchange]:
        return [e for e in self.client.exchanges if e.phase.startswith(phases)]

    # --- phases -----------------------------------------------------------------------

    async def discover(self) -> None:
        http = self.client.http
        try:
            r = await http.get(self.base + "/v1/models", headers=self.client.headers(0), timeout=30)
        except httpx.HTTPError as e:
            raise AuditError(f"cannot reach {self.base}: {e}") from e
        if r.status_code != 200:
            raise AuditError(f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
        models = r.json().get("data") or []
        if not models:
            raise AuditError("the server lists no model")
        chosen = next((m for m in models if m.get("id") == self.report.model), models[0])
        self.report.model = self.client.model = chosen["id"]
        self.report.max_model_len = self.report.max_model_len or chosen.get("max_model_len")
        self.report.pool_tokens = self.report.pool_tokens or chosen.get("kv_pool_tokens")
        made_up = {"Authorization": f"Bearer sk-audit-{self.rng.getrandbits(64):016x}"}
        body = {"model": self.client.model, "prompt": "Hello", "max_tokens": 1}
        r = await http.post(self.base + "/v1/completions", headers=made_up, json=body, timeout=60)
        if r.status_code == 200:  # served, not just listed: some servers list models to anyone
            self.report.info.append(
                "the server accepts a key the audit made up: it authenticates no one, so every "
                "client is the same tenant"
            )

    async def canary_phase(self) -> None:
        jobs = []
        for i in range(self.canaries):
            secret = "".join(self.rng.choices(string.digits, k=8))
            jobs.append(
                self.client.chat(
                    Exchange("canary", CANARY_TEMPLATE.format(s=secret), i, secret), 24
                )
            )
            if i % 6 == 5:
                probe = PROBE_PROMPTS[(i // 6) % len(PROBE_PROMPTS)]
                jobs.append(self.client.chat(Exchange("probe", probe, i), 48))
        await asyncio.gather(*jobs)
        failed = [e for e in self.exchanges("canary", "probe") if e.status != 200]
        if failed:
            self.find(
                "canary", f"{len(failed)} canary requests failed", first_error=failed[0].error
            )

    async def boundary_phase(self) -> None:
        limit, pool = self.report.max_model_len, self.report.pool_tokens
        if not limit:
            self.report.skipped.append("boundary: max_model_len unknown (pass --max-model-len)")
            return
        max_tokens = 16

        def fits(n):
            return n + max_tokens <= limit and (pool is None or n + max_tokens <= pool)

        cases = [
            ("under", limit - max_tokens - 8, fits(limit - max_tokens - 8)),
            ("prompt+max_tokens over by 1", limit - max_tokens + 1, False),
            ("at max_model_len", limit, False),
            ("max_model_len + 1", limit + 1, False),
        ]
        if pool:  # pool - 1 prompt tokens plus any output cannot fit the pool either
            cases += [("pool - 1", pool - 1, False), ("pool + 1", pool + 1, False)]
        before = len(self.report.findings)
        for name, n, servable in cases:
            if n < 1:
                continue
            prompt = await self.client.prompt_of(self.rng, n)
            exact = await self.client.count_tokens(prompt) == n
            ex = await self.client.complete(Exchange(f"boundary:{name}", prompt, 0), max_tokens)
            usage = ex.usage or {}
            if ex.status == 200 and not usage:
                usage = await self.client.usage_of(ex, max_tokens)
            if servable and ex.status != 200:
                self.find(
                    "boundary",
                    f"a servable prompt of {n} tokens ({name}) was refused with {ex.status}",
                    error=ex.error,
                )
            elif not servable and ex.status == 200 and not ex.error:
                policy = self.boundary_policy(n, limit, pool, usage, ex.text, exact)
                if policy:
                    self.report.info.append(f"boundary: {name}: {policy} (a policy, not a leak)")
                    continue
                self.find(
                    "boundary",
                    f"a prompt of {n} tokens ({name}; max_model_len {limit}, pool {pool}) was "
                    f"answered with 200 and {len(ex.text)} characters of text "
                    "instead of a 4xx refusal",
                    text=ex.text[:200],
                    usage=usage,
                )
            elif not servable and ex.status >= 500:
                self.find(
                    "boundary",
                    f"a prompt of {n} tokens ({name}) failed with {ex.status} instead of a 4xx",
                )
        if len(self.report.findings) == before:
            self.report.passed.append("boundary")

    @staticmethod
    def boundary_policy(
        n: int, limit: int, pool: int | None, usage: dict, text: str, exact: bool
    ) -> str | None:
        """What a 200 to an over-limit prompt did, where usage shows the whole prompt counted
        and nothing read past the context or the KV pool, whichever is smaller (no request's
        KV outgrows the pool); None where it may have dropped or not held part of it."""
        if not text and not usage:
            return "answered 200 with an empty stream and no usage: nothing was generated"
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not exact or prompt != n or completion is None:
            return None
        if completion == 0 and not text:
            return f"answered 200 with no output; all {n} prompt tokens were counted"
        room = min(limit, pool or limit)
        if n < room and n + completion <= room:
            return (
                f"answered 200 with max_tokens shortened to {completion}; all {n} prompt "
                "tokens were counted"
            )
        return None

    async def consistency_phase(self) -> None:
        alone = [
            await self.client.chat(Exchange("consistency:alone", p, 0), 32)
            for p in CONSISTENCY_PROMPTS
        ]
        together = [
            self.client.chat(Exchange("consistency:load", p, 0), 32) for p in CONSISTENCY_PROMPTS
        ]
        load = [
            self.client.chat(Exchange("consistency:filler", f"Write a story about {w}.", i), 32)
            for i, w in enumerate(FILLER_TOPICS)
        ]
        results = await asyncio.gather(*together, *load)
        before = len(self.report.findings)
        for a, b in zip(alone, results):
            if a.status == 200 and b.status == 200 and a.text != b.text:
                pos = next(
                    (i for i, (x, y) in enumerate(zip(a.text, b.text)) if x != y),
                    min(len(a.text), len(b.text)),
                )
                what = f"greedy output differs alone vs under load at character {pos}"
                if not b.text:
                    what = "a request under load was answered 200 with no text, alone it has text"
                self.find(
                    "consistency",
                    what,
                    prompt=a.prompt,
                    alone=a.text[pos : pos + 60],
                    under_load=b.text[pos : pos + 60],
                )
        if len(self.report.findings) == before:
            self.report.passed.append("consistency")

    async def abort_phase(self) -> None:
        """A prompt sent again after a client dropped it mid-prefill gets an answer the server
        gives that prompt undropped: no page its first try reserved but never wrote is read
        as if computed (vLLM v0 cached blocks once scheduled, #7822). Key 2 sends each prompt
        twice, fresh and then from its cache where it has one (servers whose cached answers
        differ from fresh ones by rounding give either); key 1 then drops it a quarter of the
        way into its prefill and sends it again."""
        if len(self.keys) < 2:
            self.report.skipped.append("aborted prefill: give two or more --api-key")
            return
        limit = self.report.max_model_len or ABORT_TOKENS
        tokens = min(ABORT_TOKENS, min(limit, self.report.pool_tokens or limit) - 32)
        seen = 0
        for _ in range(ABORT_TRIALS):
            prompt = await self.client.prompt_of(self.rng, tokens)
            fresh = await self.client.complete(Exchange("abort:fresh", prompt, 1), 16)
            cached = await self.client.complete(Exchange("abort:cached", prompt, 1), 16)
            await self.client.dropped(
                Exchange("abort:dropped", prompt, 0), 16, (fresh.ttft or 0) / 4
            )
            again = await self.client.complete(Exchange("abort:again", prompt, 0), 16)
            failed = next((e for e in (fresh, cached, again) if e.status != 200 or e.error), None)
            if failed or not again.ttft:  # an error event ends a stream begun as 200
                why = failed.error if failed else "answered with no text"
                self.report.inconclusive.append(
                    f"aborted prefill: a request failed ({(failed or again).status}): {why}"
                )
                continue
            if again.text not in (fresh.text, cached.text):
                self.find(
                    "abort",
                    "a prompt sent again after a client dropped it mid-prefill was answered "
                    "from KV it never computed: its greedy answer is neither the fresh one nor "
                    "the cached one",
                    cached_tokens=again.cached_tokens,
                    fresh=fresh.text[:60],
                    again=again.text[:60],
                )
                return
            # A prompt served whole from a cache (as reported, or twice as fast) tests nothing.
            whole = (again.cached_tokens or 0) > tokens / 2 or again.ttft < fresh.ttft / 2
            seen += not whole
        if seen:
            self.report.passed.append("aborted prefill")
        else:
            self.report.inconclusive.append(
                "aborted prefill: no resent prompt was computed again: each came whole from a "
                "cache, as its usage or its time to first token showed (the keys share one "
                "cache, or each drop came after the prefill)"
            )

    async def cache_phase(self) -> None:
        """The positive control within key 1, then every pair of keys (cache_probe.py)."""
        limit = self.report.max_model_len or 1024
        counted = await self.client.count_tokens(join(random_words(self.rng, 200)))
        tokens_per_word = (counted or 300) / 200  # 1.5 where the server cannot count
        room = min(limit, self.report.pool_tokens or limit) - 8
        probe = CacheProbe(self.client, self.rng)
        pairs = list(itertools.combinations(range(len(self.keys)), 2))
        try:
            max_words = min(int(room / tokens_per_word), MAX_WORDS)
            min_words = int(self.cache_min_tokens / tokens_per_word) + 1
            calibration = await probe.calibrate(min(min_words, max_words), max_words)
            if calibration.problem:
                self.report.inconclusive.append(f"prefix cache: {calibration.problem}")
                return
            deadline = self.started + self.budget_s - 15  # the timing phase runs after
            share = (deadline - time.monotonic()) / (1 + len(pairs))
            control = await probe.run(
                CacheTest(0, 0, self.alpha), calibration, time.monotonic() + share
            )
            self.report.cache.append(control.summary())
            if control.verdict != "shared":
                what = "visible" if control.verdict == "inconclusive" else "seen"
                self.report.info.append(
                    f"prefix cache: none {what} within one key ({control.reason})"
                )
                if pairs:
                    self.report.inconclusive.append(
                        "cross-key prefix cache: no cache visible within one key, so none "
                        "can be seen across keys"
                    )
                return
            self.report.info.append(f"prefix cache: visible within one key ({control.reason})")
            if not pairs:
                self.report.skipped.append("cross-key prefix cache: give two or more --api-key")
                return
            for victim, attacker in pairs:
                test = CacheTest(victim, attacker, self.alpha / len(pairs))
                await probe.run(test, calibration, time.monotonic() + share)
                self.report.cache.append(test.summary())
                self.cache_verdict(test)
        except ProbeError as e:
            self.report.inconclusive.append(f"prefix cache: {e}")

    def cache_verdict(self, test: CacheTest) -> None:
        pair = f"key {test.victim + 1} -> key {test.attacker + 1}"
        s = test.summary()
        figures = {
            k: s[k]
            for k in (
                "hit_median_ms",
                "miss_median_ms",
                "ks_statistic",
                "p_value",
                "max_cached_tokens",
            )
        }
        if test.verdict == "shared":
            self.find(
                "cross-key-cache",
                f"one prefix cache serves several keys: key {test.attacker + 1}'s first token "
                f"comes sooner when key {test.victim + 1} sent the same prefix before "
                f"({test.reason}; one-sided KS p = {test.p_value:.3g} < {test.look_alpha:.3g})",
                **figures,
            )
        elif max(test.cached_tokens, default=0) > 0:
            self.find(
                "cross-key-cache",
                f"the server reports {max(test.cached_tokens)} cached prompt tokens for key "
                f"{test.attacker + 1}'s prompt, whose prefix only key {test.victim + 1} sent",
                **figures,
            )
        elif test.verdict == "not shared":
            self.report.passed.append(f"cross-key prefix cache ({pair}: {test.reason})")
        else:
            self.report.inconclusive.append(f"cross-key prefix cache ({pair}: {test.reason})")

    async def timing_phase(self) -> None:
        """A prompt answered faster than the server can read it was not fully processed.
        Only prompts that share nothing with any earlier one are timed, less any tokens the
        server says it had cached."""
        prompt = await self.client.prompt_of(self.rng, 128)
        short = await self.client.complete(Exchange("timing:short", prompt, 0), 4)
        before = len(self.report.findings)
        if short.status == 200 and short.ttft:
            floor_rate = 128 / short.ttft  # a lower bound of the server's prefill speed
            for ex in self.exchanges("boundary", "timing"):
                n = (ex.usage or {}).get("prompt_tokens", 0) - (ex.cached_tokens or 0)
                if ex.status == 200 and ex.ttft and n >= 512 and n / ex.ttft > 8 * floor_rate:
                    self.find(
                        "timing",
                        f"{ex.phase}: {n} prompt tokens answered in {ex.ttft:.3f} s, "
                        f"{n / ex.ttft:.0f} tok/s against a measured {floor_rate:.0f} tok/s "
                        "for 128 tokens: the prompt cannot have been fully processed",
                    )
        for ex in self.exchanges("boundary", "timing"):
            if ex.status != 200 or not ex.usage:
                continue
            counted = await self.client.count_tokens(ex.prompt)
            if counted is not None and ex.usage.get("prompt_tokens") != counted:
                self.find(
                    "accounting",
                    f"{ex.phase}: usage.prompt_tokens is {ex.usage.get('prompt_tokens')} "
                    f"but the prompt has {counted} tokens",
                )
        if len(self.report.findings) == before:
            self.report.passed.append("timing and accounting")

    def leak_scan(self) -> None:
        exchanges = self.client.exchanges
        secrets = {e.secret: e for e in exchanges if e.secret}
        before = len(self.report.findings)
        for ex in exchanges:
            for secret, owner in secrets.items():
                if secret in ex.text and owner is not ex:
                    self.find(
                        "leak",
                        f"a response to a {ex.phase} request contains another request's secret",
                        secret=secret,
                        owner_key=owner.key_index % len(self.keys),
                        reader_key=ex.key_index % len(self.keys),
                        text=ex.text[:200],
                    )
            if (
                not ex.secret
                and CANARY_PHRASE not in ex.prompt.lower()
                and CANARY_PHRASE in ex.text.lower()
            ):
                self.find(
                    "leak",
                    f"a response to a {ex.phase} request quotes other requests' prompts "
                    f"('{CANARY_PHRASE}' appears only there)",
                    text=ex.text[:200],
                )
        if len(self.report.findings) == before:
            self.report.passed.append("canary leak")

    async def internal_phase(self) -> None:
        """Every internal endpoint of every worker refuses a client key and no key."""
        probes = await probe_workers(self.workers, [k for k in self.keys if k])
        before = len(self.report.findings)
        for p in probes:
            if p.answered:
                who = "no key" if p.key_index is None else f"client key #{p.key_index + 1}"
                self.find(
                    "internal_endpoints",
                    f"{p.method} {p.worker}{p.path} answered {p.status} to {who}; "
                    "it must refuse (401) anyone without the cluster's internal token",
                    worker=p.worker,
                    path=p.path,
                    status=p.status,
                    code=p.error_code,
                )
        unreachable = sorted({p.worker for p in probes if p.failure})
        if unreachable:
            self.report.skipped.append(
                f"internal endpoints of {', '.join(unreachable)} (unreachable)"
            )
        if len(self.report.findings) == before and len(unreachable) < len(self.workers):
            self.report.passed.append("internal endpoints refuse clients")

    async def run(self) -> Report:
        if self.workers:
            await self.internal_phase()
        if self.base is None:  # only the workers were given
            return self.report
        phases = {
            "canary": self.canary_phase,
            "boundary": self.boundary_phase,
            "consistency": self.consistency_phase,
            "abort": self.abort_phase,
            "cache": self.cache_phase,
            "timing": self.timing_phase,
        }
        bar = tqdm(desc="auditing", unit="req", disable=not self.progress)
        self.client.on_exchange = lambda: bar.update(1)
        try:
            await self.discover()
            for name in CHECKS:
                if name in self.checks:
                    await phases[name]()
        finally:
            bar.close()
            await self.client.http.aclose()
        self.leak_scan()
        self.report.requests = len(self.client.exchanges)
        self.report.seconds = time.monotonic() - self.started
        return self.report
