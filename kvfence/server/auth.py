"""API keys and tenants. The tenant comes from the key alone, never from a request field.

The `--api-keys` file maps each key to a tenant name, or to an object naming the tenant with
its share and limits (every field optional):

    {"sk-a": {"tenant": "alice", "weight": 2, "max_concurrent_requests": 16,
              "max_tokens_per_minute": 200000, "max_queued_requests": 64, "admin": false}}

Limits belong to the tenant, so keys of one tenant share them; `admin` belongs to the key.
"""

import hashlib
import hmac
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_TENANT = "default"


class Tenant(BaseModel):
    """A tenant's share of the server and its limits (None: no limit)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    name: str = Field(DEFAULT_TENANT, min_length=1)
    weight: float = Field(1.0, gt=0, le=1e6)  # share under fair scheduling, relative to others
    max_concurrent_requests: int | None = Field(None, ge=1)  # sequences running at once; more wait
    max_queued_requests: int | None = Field(None, ge=0)  # sequences waiting beyond those; more: 429
    max_tokens_per_minute: int | None = Field(None, ge=1)  # prompt + output tokens, sliding minute


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tenant: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0, le=1e6)
    max_concurrent_requests: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(None, ge=0)
    max_tokens_per_minute: int | None = Field(None, ge=1)
    admin: bool = False

    def limits(self) -> Tenant:
        return Tenant(
            name=self.tenant,
            **self.model_dump(exclude={"tenant", "admin"}, exclude_unset=True),
        )


def _line_of(text: str, key: str) -> int:
    return text[: max(text.find(json.dumps(key)), 0)].count("\n") + 1


def _shown(key: str) -> str:
    return json.dumps(key[:6] + "..." if len(key) > 8 else key)  # keys are secrets: a prefix only


class ApiKeys:
    def __init__(self, keys: dict[str, str | KeyEntry] | None = None):
        entries = {
            k: KeyEntry(tenant=v) if isinstance(v, str) else v for k, v in (keys or {}).items()
        }
        self.tenants: dict[str, Tenant] = {}
        for entry in entries.values():
            if entry.model_fields_set - {"tenant", "admin"} or entry.tenant not in self.tenants:
                self.tenants[entry.tenant] = entry.limits()
        # Compare digests, so every comparison has the same length whatever the key.
        self._keys = [
            (hashlib.sha256(k.encode()).digest(), e.tenant, e.admin) for k, e in entries.items()
        ]

    @classmethod
    def from_file(cls, path: str | Path) -> "ApiKeys":
        try:
            text = Path(path).read_text()
            data = json.loads(text)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read API keys from {path}: {e}") from e
        if (
            not isinstance(data, dict)
            or not data
            or not all(isinstance(k, str) and k for k in data)
        ):
            raise ValueError(
                f"{path} must be a non-empty JSON object mapping each key to a tenant name "
                'or to an object with a "tenant" field'
            )
        entries: dict[str, KeyEntry] = {}
        for key, value in data.items():
            where = f"{path} line {_line_of(text, key)}, key {_shown(key)}"
            try:
                entries[key] = (
                    KeyEntry(tenant=value)
                    if isinstance(value, str)
                    else KeyEntry.model_validate(value)
                )
            except ValidationError as e:
                err = e.errors()[0]
                field = ".".join(str(p) for p in err["loc"]) or "value"
                raise ValueError(f"{where}: field '{field}': {err['msg']}") from None
        limited = {}
        for key, entry in entries.items():
            if entry.model_fields_set - {"tenant", "admin"}:
                other = limited.setdefault(entry.tenant, (key, entry.limits()))
                if other[1] != entry.limits():
                    raise ValueError(
                        f"{path} line {_line_of(text, key)}: tenant '{entry.tenant}' is given "
                        f"other limits than at line {_line_of(text, other[0])}; keys of one "
                        "tenant share its limits, so give them once"
                    )
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def _lookup(self, authorization: str | None) -> tuple[str, bool] | None:
        """(tenant, admin) of a `Bearer KEY` header, or None. Checks every key, in constant time."""
        if not self.enabled:
            return DEFAULT_TENANT, False
        scheme, _, key = (authorization or "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for known, tenant, admin in self._keys:
            if hmac.compare_digest(known, digest) and scheme.lower() == "bearer":
                found = tenant, admin
        return found

    def tenant_for(self, authorization: str | None) -> str | None:
        found = self._lookup(authorization)
        return found[0] if found else None

    def is_admin(self, authorization: str | None) -> bool:
        found = self._lookup(authorization)
        return bool(found and found[1])

    def limits(self, tenant: str) -> Tenant:
        return self.tenants.get(tenant) or Tenant(name=tenant)
