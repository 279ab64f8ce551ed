"""Cross-key prefix-cache probe, after Gu et al., "Auditing Prompt Caching in Language Model
APIs" (ICML 2025): does a prompt one key sent make another key's first token come sooner?

Each trial, the victim key sends a fresh random prompt; the attacker key then sends either a
prompt sharing its first 95% (a hit, if the cache is shared) or a fresh prompt of the same
length (a miss). Times to the first token of the two kinds are compared with a one-sided
two-sample Kolmogorov-Smirnov test. The prompt length is sized first, so that a miss costs at
least MARGIN times the timing noise, and is at least --cache-min-tokens long, since caches
share whole blocks (vLLM's CPU build 128 tokens) or only long prompts (1024 tokens at some
providers). The test is run at a few fixed trial counts (LOOKS), each at the level divided by
their number (Bonferroni), so that stopping at the first decisive one keeps the false-positive
rate at the level; testing after every trial would about double it.
The same procedure within one key is the positive control: a server whose cache it cannot see
gets "inconclusive", never "not shared".
"""

import random
import statistics
import time
from dataclasses import dataclass, field

from scipy.stats import ks_2samp

from kvfence.audit.client import AuditClient, Exchange
from kvfence.audit.prompts import join, random_words

MARGIN = 20  # a miss must cost this many times the timing noise
SHARED_FRACTION = 0.95
LOOKS = (8, 20, 40, 80, 160, 250)  # trials per condition at which to test; 250 as Gu et al.
MIN_TRIALS, MAX_TRIALS = LOOKS[0], LOOKS[-1]
NEGATIVE_TRIALS = 20  # per condition, before "not shared" can be decisive
MAX_WORDS = 4096


@dataclass
class Calibration:
    noise_s: float  # robust spread of the time to first token of one short fresh prompt
    per_word_s: float  # prefill time a prompt word adds
    words: int  # prompt length the trials use
    expected_gap_s: float  # what a hit saves, if the cache is shared
    problem: str | None = None  # why no trial can decide, if so


@dataclass
class CacheTest:
    """One (victim, attacker) pair of keys, or a key with itself (the positive control)."""

    victim: int
    attacker: int
    alpha: float
    hit_s: list[float] = field(default_factory=list)
    miss_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)  # reported on hits, where reported
    p_value: float | None = None
    statistic: float | None = None
    verdict: str = "inconclusive"  # shared / not shared / inconclusive
    reason: str = ""

    @property
    def control(self) -> bool:
        return self.victim == self.attacker

    @property
    def look_alpha(self) -> float:
        """The level of each look (the deadline's look takes the place of a later one)."""
        return self.alpha / len(LOOKS)

    def summary(self) -> dict:
        med = statistics.median
        return {
            "victim_key": self.victim + 1,
            "attacker_key": self.attacker + 1,
            "verdict": self.verdict,
            "reason": self.reason,
            "trials": [len(self.hit_s), len(self.miss_s)],
            "hit_median_ms": round(1000 * med(self.hit_s), 2) if self.hit_s else None,
            "miss_median_ms": round(1000 * med(self.miss_s), 2) if self.miss_s else None,
            "ks_statistic": self.statistic,
            "p_value": self.p_value,
            "alpha": self.alpha,
            "alpha_per_look": self.look_alpha,
            "max_cached_tokens": max(self.cached_tokens, default=None),
        }

    def decide(self, calibration: Calibration, final: bool) -> bool:
        """Updates the verdict at a look, or at the deadline (`final`); True once decisive."""
        n = min(len(self.hit_s), len(self.miss_s))
        if n < MIN_TRIALS or (n not in LOOKS and not final):
            return False
        test = ks_2samp(self.hit_s, self.miss_s, alternative="greater")  # hits come sooner
        self.p_value, self.statistic = float(test.pvalue), float(test.statistic)
        gap = statistics.median(self.miss_s) - statistics.median(self.hit_s)
        if self.p_value < self.look_alpha:
            self.verdict = "shared"
            self.reason = f"hits {1000 * gap:.1f} ms sooner (median)"
            return True
        small = gap < calibration.expected_gap_s / 4
        if (n >= NEGATIVE_TRIALS and small) or n >= MAX_TRIALS:
            self.verdict = "not shared"
            self.reason = (
                f"median gap {1000 * gap:.1f} ms where a shared cache would save "
                f"{1000 * calibration.expected_gap_s:.0f} ms"
            )
            return True
        if final:
            self.reason = f"budget spent after {n} trials of each kind, p = {self.p_value:.3g}"
        return False


class CacheProbe:
    def __init__(self, client: AuditClient, rng: random.Random):
        self.client, self.rng = client, rng

    async def first_token(self, key: int, words: list[str], phase: str):
        """Time to the first token of a one-token completion, and the exchange."""
        ex = await self.client.complete(Exchange(phase, join(words), key), 1)
        if ex.status != 200 or ex.ttft is None:
            raise ProbeError(f"a timing request failed ({ex.status}): {ex.error}")
        return ex.ttft, ex

    async def calibrate(self, min_words: int, max_words: int) -> Calibration:
        short = [
            (await self.first_token(0, random_words(self.rng, 16), "cache:calibrate"))[0]
            for _ in range(10)
        ]
        base = statistics.median(short)
        noise = 1.4826 * statistics.median(abs(t - base) for t in short)
        noise = max(noise, 1e-4)  # the clock and the loop are no finer than this
        long_words = min(256, max_words)
        longs = [
            (await self.first_token(0, random_words(self.rng, long_words), "cache:calibrate"))[0]
            for _ in range(3)
        ]
        per_word = (statistics.median(longs) - base) / (long_words - 16)
        if per_word <= 0:
            return Calibration(noise, per_word, 0, 0, "prefill time does not grow with length")
        words = int(MARGIN * noise / (SHARED_FRACTION * per_word)) + 1
        problem = None
        if words > max_words:
            problem = (
                f"a miss would need {words} words to cost {MARGIN}x the timing noise "
                f"({1000 * noise:.1f} ms); the context holds {max_words}"
            )
        words = min(max(words, min_words, 32), max_words)
        return Calibration(noise, per_word, words, SHARED_FRACTION * per_word * words, problem)

    async def trial(self, test: CacheTest, words: int, hit: bool) -> None:
        victim = random_words(self.rng, words)
        await self.first_token(test.victim, victim, "cache:victim")
        shared = int(SHARED_FRACTION * words) if hit else 0
        prompt = victim[:shared] + random_words(self.rng, words - shared)
        ttft, ex = await self.first_token(test.attacker, prompt, "cache:attacker")
        (test.hit_s if hit else test.miss_s).append(ttft)
        if hit and ex.cached_tokens is not None:
            test.cached_tokens.append(ex.cached_tokens)

    async def run(self, test: CacheTest, calibration: Calibration, deadline: float) -> CacheTest:
        """Trials in shuffled pairs of conditions until decisive, MAX_TRIALS or `deadline`."""
        while time.monotonic() < deadline:
            pair = [True, False]
            self.rng.shuffle(pair)
            for hit in pair:
                await self.trial(test, calibration.words, hit)
            if test.decide(calibration, final=False):
                return test
        test.decide(calibration, final=True)
        return test


class ProbeError(Exception):
    """A timing request failed: the probe cannot go on."""
