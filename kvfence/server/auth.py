"""API keys and tenants. The tenant comes from the key alone, never from a request field."""
import hashlib
import hmac
import json
from pathlib import Path

DEFAULT_TENANT = "default"


class ApiKeys:
    def __init__(self, keys: dict[str, str] | None = None):
        # Compare digests, so every comparison has the same length whatever the key.
        self._keys = [(hashlib.sha256(k.encode()).digest(), tenant) for k, tenant in (keys or {}).items()]

    @classmethod
    def from_file(cls, path: str | Path) -> "ApiKeys":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read API keys from {path}: {e}") from e
        if not isinstance(data, dict) or not data or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in data.items()):
            raise ValueError(f"{path} must be a non-empty JSON object mapping each key to a tenant name")
        return cls(data)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of a `Bearer KEY` header, or None. Checks every key, in constant time."""
        if not self.enabled:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for known, tenant in self._keys:
            if hmac.compare_digest(known, digest) and scheme.lower() == "bearer":
                found = tenant
        return found
