"""Per-tenant limits, checked before a request reaches the engine: sequences in flight, and
prompt + output tokens in a sliding minute. A request is charged its prompt plus n times its
max_tokens when admitted, and refunded what it did not generate when it ends, so a tenant
is refused exactly when a request could take it over its limit."""

import math
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from kvfence.server.auth import ApiKeys

WINDOW_S = 60.0


class OverQuota(Exception):
    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


@dataclass
class Charge:
    tenant: str
    sequences: int
    tokens: list  # the window entry [time, tokens], refunded in place when the request ends


class Quotas:
    def __init__(self, keys: ApiKeys, clock=time.monotonic):
        self.keys = keys
        self.clock = clock
        self._lock = threading.Lock()
        self._sequences: dict[str, int] = defaultdict(int)
        self._window: dict[str, deque] = defaultdict(deque)

    def charge(self, tenant: str, sequences: int, tokens: int) -> Charge:
        """Takes `sequences` and `tokens` from the tenant's limits, or raises OverQuota."""
        if sequences < 1 or tokens < 0:  # a negative charge would credit the tenant
            raise ValueError(f"a charge of {sequences} sequences and {tokens} tokens")
        limits = self.keys.limits(tenant)
        most = (
            None  # the engine runs max_concurrent_requests at once; max_queued_requests more wait
        )
        if limits.max_concurrent_requests is not None or limits.max_queued_requests is not None:
            most = (limits.max_concurrent_requests or 0) + (limits.max_queued_requests or 0)
        with self._lock:
            if most is not None and self._sequences[tenant] + sequences > most:
                raise OverQuota(
                    f"tenant '{tenant}' has {self._sequences[tenant]} sequences in flight; this "
                    f"request adds {sequences} and the limit is {most} (max_concurrent_requests "
                    "+ max_queued_requests)",
                    1,
                )
            entry = [self.clock(), 0]
            self._take_tokens(tenant, entry, tokens)
            if limits.max_tokens_per_minute is not None:
                self._window[tenant].append(entry)
            self._sequences[tenant] += sequences
        return Charge(tenant, sequences, entry)

    def add(self, charge: Charge, tokens: int) -> None:
        """Adds tokens already spent to a charge, whatever the limit (a disaggregated
        request's prompt, once its prefill worker has computed it)."""
        with self._lock:
            charge.tokens[1] += max(0, tokens)

    def extend(self, charge: Charge, tokens: int) -> None:
        """Adds `tokens` to a charge once they are known (a disaggregated request's, after its
        prefill worker admitted it), or raises OverQuota, the charge unchanged."""
        if tokens < 0:
            raise ValueError(f"a charge of {tokens} tokens")
        with self._lock:
            self._take_tokens(charge.tenant, charge.tokens, tokens)

    def _take_tokens(self, tenant: str, entry: list, tokens: int) -> None:
        limit = self.keys.limits(tenant).max_tokens_per_minute
        if limit is not None:
            window = self._expire(tenant)
            used = sum(t for _, t in window)
            if used + tokens > limit:
                raise OverQuota(
                    f"tenant '{tenant}' has used {used} of its {limit} tokens per minute; this "
                    f"request may take {tokens} more (prompt + n x max_tokens)",
                    self._wait_for(window, used + tokens - limit),
                )
        entry[1] += tokens

    def refund(self, charge: Charge, unused_tokens: int) -> None:
        """The request has ended: its sequences are free, and tokens it did not use return."""
        with self._lock:
            self._sequences[charge.tenant] -= charge.sequences
            charge.tokens[1] -= max(0, min(unused_tokens, charge.tokens[1]))

    def in_flight(self, tenant: str) -> int:
        return self._sequences[tenant]

    def _expire(self, tenant: str) -> deque:
        window, now = self._window[tenant], self.clock()
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        return window

    def _wait_for(self, window: deque, excess: int) -> float:
        """Seconds until entries holding `excess` tokens leave the window."""
        freed = 0
        for at, tokens in window:
            freed += tokens
            if freed >= excess:
                return at + WINDOW_S - self.clock()
        return WINDOW_S
