"""`kvfence audit` (auditor.py) and `kvfence check-config` (check_config.py)."""

# The audit's checks, in the order they run.
CHECKS = ("canary", "boundary", "consistency", "abort", "cache", "timing")
