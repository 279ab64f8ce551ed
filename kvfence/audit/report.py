"""What an audit found, and its three renderings: a summary for people, JSON, and JUnit XML
for CI pipelines. Exit codes: 0 clean, 1 findings (or, under --strict, inconclusive checks),
2 the audit could not run."""

import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field

# The known leak classes (README, "Checking a deployment") each check's finding is evidence of.
LEAK_CLASSES = {
    "boundary": "legacy-reject-path: prompts cut to placeholders (the 2026 incident)",
    "timing": "legacy-reject-path: prompts cut to placeholders (the 2026 incident)",
    "canary": "truncated-transfer, where the errors are KV transfers that failed",
    "leak": "stale or shared KV: stale-lease, stale-block-reuse, shared-prefix-cache",
    "consistency": "freed pages still read: stale-block-reuse, stale-lease",
    "abort": "unwritten-prefix-read: cached pages read before they were written",
    "cross-key-cache": "shared-prefix-cache: one prefix cache for every tenant",
}


@dataclass
class Finding:
    check: str
    message: str
    detail: dict = field(default_factory=dict)
    leak_class: str = field(init=False)

    def __post_init__(self):
        self.leak_class = LEAK_CLASSES.get(self.check, "")


@dataclass
class Report:
    base_url: str
    model: str = ""
    max_model_len: int | None = None
    pool_tokens: int | None = None
    findings: list[Finding] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    inconclusive: list[str] = field(default_factory=list)  # ran, could not decide
    skipped: list[str] = field(default_factory=list)  # not run
    info: list[str] = field(default_factory=list)  # true, and not a leak
    cache: list[dict] = field(default_factory=list)  # the prefix-cache tests' figures
    requests: int = 0
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        if self.findings:
            return "findings"
        return "inconclusive" if self.inconclusive else "clean"

    def exit_code(self, strict: bool) -> int:
        return 1 if self.findings or (strict and self.inconclusive) else 0

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def format_report(report: Report) -> str:
    lines = [
        f"kvfence audit of {report.base_url} (model {report.model}, "
        f"max_model_len {report.max_model_len}, "
        f"pool {report.pool_tokens or 'unknown'} tokens, {report.requests} requests, "
        f"{report.seconds:.0f} s)"
        if report.base_url
        else "kvfence audit of the workers' internal endpoints"
    ]
    lines += [f"  PASS  {name}" for name in report.passed]
    lines += [f"  INFO  {text}" for text in report.info]
    lines += [f"  ????  {text}" for text in report.inconclusive]
    lines += [f"  SKIP  {name}" for name in report.skipped]
    for f in report.findings:
        lines.append(f"  FAIL  [{f.check}] {f.message}")
        if f.leak_class:
            lines.append(f"          leak class: {f.leak_class}")
        for k, v in f.detail.items():
            lines.append(
                f"          {k}: {str(v)[:160]!r}" if isinstance(v, str) else f"          {k}: {v}"
            )
    for t in report.cache:
        lines.append(
            f"  cache key {t['victim_key']} -> key {t['attacker_key']}: {t['verdict']}; "
            f"first token {t['hit_median_ms']} ms after a shared prefix vs "
            f"{t['miss_median_ms']} ms fresh (medians of {t['trials'][0]}/{t['trials'][1]}), "
            f"KS D={t['ks_statistic'] or 0:.2f}, p={t['p_value'] or 1:.3g}, alpha={t['alpha']:.3g}"
        )
    verdict = report.verdict
    if report.findings:
        verdict = f"FINDINGS ({len(report.findings)})"
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def junit_xml(report: Report) -> str:
    """One test case per check: a failure per finding, skipped for inconclusive or not run."""
    suite = ET.Element("testsuite", name="kvfence-audit", time=f"{report.seconds:.1f}")
    for name in report.passed + report.info:
        ET.SubElement(suite, "testcase", classname="audit", name=name)
    for name in report.inconclusive:
        case = ET.SubElement(suite, "testcase", classname="audit", name=name)
        ET.SubElement(case, "skipped", message=f"inconclusive: {name}")
    for name in report.skipped:
        case = ET.SubElement(suite, "testcase", classname="audit", name=name)
        ET.SubElement(case, "skipped", message=f"not run: {name}")
    for f in report.findings:
        case = ET.SubElement(suite, "testcase", classname="audit", name=f.check)
        failure = ET.SubElement(case, "failure", message=f.message, type=f.check)
        detail = {"leak class": f.leak_class, **f.detail} if f.leak_class else f.detail
        failure.text = "\n".join(f"{k}: {v}" for k, v in detail.items())
    counts = {
        "tests": len(suite),
        "failures": len(report.findings),
        "skipped": len(report.inconclusive) + len(report.skipped),
    }
    for k, v in counts.items():
        suite.set(k, str(v))
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
