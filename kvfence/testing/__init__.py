"""Test-only code: imported by a server's or an offline engine's assembly only when a fault is
injected, which the configuration allows only with KVFENCE_ALLOW_FAULTS=1."""
