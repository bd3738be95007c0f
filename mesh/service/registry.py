"""The registry: tenants, their API keys (hashes only) and their models, in SQLite.

One file, `<data dir>/registry.sqlite3`, opened by the control service's event-loop thread
only. Timestamps are the database's own clock (`strftime('%s','now')`), so the service
reads no wall clock for them. Deleting a tenant deletes its keys and models (foreign keys
with ON DELETE CASCADE).

Schema 2 adds each tenant's quota settings (`tenant_quotas`, a JSON object of the quotas the
operator set; mesh.policy.quota) and each model's sampling defaults (`models.sampling_defaults`,
JSON); a schema-1 file is upgraded in place when opened.

Schema 3 adds `prepared_formats`: the copies of a model the service prepared for the other
kind of node (mesh.service.preparation: a GGUF converted to a Hugging Face folder for vLLM, a
Hugging Face folder exported to OpenVINO IR), one row per (model, node kind) with its state
(preparing, ready, failed and why). Rows go with their model (ON DELETE CASCADE); an older
file gets the table when opened.

Schema 4 adds `models.cold_start`: what a request gets when its model is cold and cannot
make its TTFT (`serve_late`, the default, or `reject`; docs/service.md, "Cold starts").
Schema 5 adds `models.admission`: what a request that can no longer meet its SLO gets
(`reject`, `queue`, `late`; NULL: the tenant's default, else the service's `--admission`;
docs/service.md, "Admission"), and `tenant_admission`, each tenant's default for its models.
Schema 6 adds `adapters`: tenants' LoRA adapters, each on a registered base model whose
instances run its requests (mesh.modelfiles.lora; docs/service.md, "LoRA adapters"); an
adapter goes with its tenant and with its base (ON DELETE CASCADE); an older file gets the
table when opened.
"""
from __future__ import annotations

import json
import re
import secrets
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from mesh.policy.dispatch_rules import CPU, GPU, SERVE_LATE, kind_rank
from mesh.policy.slo import SLO

SCHEMA_VERSION = 6
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL DEFAULT (CAST(strftime('%s','now') AS INTEGER))
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    key_hash TEXT NOT NULL UNIQUE,
    display TEXT NOT NULL,
    label TEXT NOT NULL DEFAULT '',
    created_at INTEGER NOT NULL DEFAULT (CAST(strftime('%s','now') AS INTEGER)),
    revoked_at INTEGER
);
CREATE TABLE IF NOT EXISTS models (
    uid TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    path TEXT NOT NULL,
    owned_file INTEGER NOT NULL DEFAULT 0,
    sha256 TEXT,
    weight_bytes INTEGER NOT NULL DEFAULT 0,
    context_length INTEGER NOT NULL,
    ttft_min_s REAL NOT NULL,
    ttft_s_per_prompt_token REAL NOT NULL,
    tpot_s REAL NOT NULL,
    created_at INTEGER NOT NULL DEFAULT (CAST(strftime('%s','now') AS INTEGER)),
    sampling_defaults TEXT NOT NULL DEFAULT '{}',
    cold_start TEXT NOT NULL DEFAULT 'serve_late',
    admission TEXT,
    UNIQUE (tenant, name)
);
CREATE TABLE IF NOT EXISTS tenant_quotas (
    tenant TEXT PRIMARY KEY REFERENCES tenants(name) ON DELETE CASCADE,
    settings TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tenant_admission (
    tenant TEXT PRIMARY KEY REFERENCES tenants(name) ON DELETE CASCADE,
    admission TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS adapters (
    uid TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    base_uid TEXT NOT NULL REFERENCES models(uid) ON DELETE CASCADE,
    path TEXT NOT NULL,
    rank INTEGER NOT NULL,
    scale REAL NOT NULL,
    weight_bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL DEFAULT (CAST(strftime('%s','now') AS INTEGER)),
    UNIQUE (tenant, name)
);
CREATE TABLE IF NOT EXISTS prepared_formats (
    model_uid TEXT NOT NULL REFERENCES models(uid) ON DELETE CASCADE,
    node_kind TEXT NOT NULL,
    format TEXT NOT NULL,
    path TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    weight_bytes INTEGER NOT NULL DEFAULT 0,
    seconds REAL,
    updated_at INTEGER NOT NULL DEFAULT (CAST(strftime('%s','now') AS INTEGER)),
    PRIMARY KEY (model_uid, node_kind)
);
"""
NATIVE_KIND = {"gguf": CPU, "ir": CPU, "hf": GPU, "emulated": CPU}  # the node kind that runs each registered
# format (an emulated model runs on both kinds as registered: mesh.modelfiles.formats.EMULATED)
PREPARED_STATES = ("preparing", "ready", "failed")


class RegistryError(ValueError):
    """A registry operation was refused (bad name, duplicate, unknown tenant)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    created_at: int


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: str
    tenant: str
    display: str
    label: str
    created_at: int
    revoked_at: int | None


@dataclass(frozen=True, slots=True)
class PreparedFormat:
    """A copy of a model the service prepared for one kind of node (mesh.service.preparation)."""

    node_kind: str  # "cpu" or "gpu": the nodes that run it
    format: str  # "hf" (vLLM) or "ir" (OpenVINO)
    path: str  # the prepared file or folder, in the service's data folder
    state: str  # "preparing", "ready" or "failed"
    reason: str = ""  # why it failed
    weight_bytes: int = 0
    seconds: float | None = None  # how long the preparation took
    updated_at: int = 0

    def __post_init__(self) -> None:
        if self.state not in PREPARED_STATES:
            raise RegistryError(f"prepared format state must be one of {', '.join(PREPARED_STATES)}, "
                                f"got {self.state!r}")

    @property
    def ready(self) -> bool:
        return self.state == "ready"


@dataclass(frozen=True, slots=True)
class ModelRecord:
    uid: str
    tenant: str
    name: str
    kind: str  # "gguf", "ir", "hf", or "emulated" (path: the catalog name; mesh.engines.emulation)
    path: str
    context_length: int
    slo: SLO
    weight_bytes: int = 0
    sha256: str | None = None
    owned_file: bool = False  # an upload kept in the data folder: deleted with the model
    created_at: int = 0
    # temperature/top_p for requests that omit them (mesh.modelfiles.sampling)
    sampling_defaults: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    prepared: tuple[PreparedFormat, ...] = ()  # formats prepared for the other kind of node
    # a request that its cold model cannot serve within its TTFT: served late or turned away
    # (mesh.policy.dispatch_rules.COLD_START_CHOICES; docs/service.md, "Cold starts")
    cold_start: str = SERVE_LATE
    # a request that can no longer meet its SLO (mesh.policy.dispatch_rules.ADMISSIONS); None: the service's default
    admission: str | None = None

    @property
    def native_kind(self) -> str:
        """The nodes that run the registered format: Hugging Face folders on GPU nodes
        (vLLM), GGUF and OpenVINO IR on CPU nodes (OpenVINO)."""
        return NATIVE_KIND[self.kind]

    @property
    def node_kinds(self) -> tuple[str, ...]:
        """The kinds of node that can run it now: its registered format's, and each kind
        whose prepared format is ready; CPU first."""
        if self.kind == "emulated":  # a catalog name: every kind of emulated node runs it as it is
            return (CPU, GPU)
        kinds = {self.native_kind, *(p.node_kind for p in self.prepared if p.ready)}
        return tuple(sorted(kinds, key=kind_rank))

    def prepared_for(self, kind: str) -> PreparedFormat | None:
        return next((p for p in self.prepared if p.node_kind == kind), None)

    def path_for(self, kind: str) -> str:
        """The file or folder that nodes of `kind` run; KeyError if it has none ready."""
        if kind == self.native_kind or self.kind == "emulated":
            return self.path
        prepared = self.prepared_for(kind)
        if prepared is None or not prepared.ready:
            raise KeyError(f"model {self.tenant}/{self.name} has no format ready for {kind} nodes")
        return prepared.path

    def format_for(self, kind: str) -> str:
        """The format nodes of `kind` run: the registered kind, or the prepared one."""
        if kind == self.native_kind:
            return self.kind
        prepared = self.prepared_for(kind)
        return prepared.format if prepared is not None else ""


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """A tenant's LoRA adapter on a registered base model (`base_uid`, possibly another tenant's,
    shared by the operator): requests that name it run in the base's instances with the
    adapter chosen per request. `path` is its weights file (adapter_model.safetensors) and
    `scale` its PEFT scale (lora_alpha / r)."""

    uid: str
    tenant: str
    name: str
    base_uid: str
    path: str
    rank: int
    scale: float
    weight_bytes: int
    created_at: int = 0


class Registry:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None)  # autocommit; explicit transactions
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.executescript(_SCHEMA)
        columns = {r["name"] for r in self._db.execute("PRAGMA table_info(models)")}
        if "sampling_defaults" not in columns:  # a schema-1 registry
            self._db.execute("ALTER TABLE models ADD COLUMN sampling_defaults TEXT NOT NULL DEFAULT '{}'")
        if "cold_start" not in columns:  # before schema 3
            self._db.execute("ALTER TABLE models ADD COLUMN cold_start TEXT NOT NULL DEFAULT 'serve_late'")
        if "admission" not in columns:  # before schema 5
            self._db.execute("ALTER TABLE models ADD COLUMN admission TEXT")
        self._db.execute("INSERT INTO meta (key, value) VALUES ('schema', ?) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        self._db.close()

    # ---- tenants -------------------------------------------------------------------------
    def create_tenant(self, name: str) -> Tenant:
        if not isinstance(name, str) or not TENANT_NAME.match(name):
            raise RegistryError("tenant names are 1-63 characters: lowercase letters, digits, '_', '.', '-', "
                                "starting with a letter or digit")
        try:
            self._db.execute("INSERT INTO tenants (name) VALUES (?)", (name,))
        except sqlite3.IntegrityError as exc:
            raise RegistryError(f"tenant {name!r} already exists") from exc
        return self.tenant(name)

    def tenant(self, name: str) -> Tenant | None:
        row = self._db.execute("SELECT name, created_at FROM tenants WHERE name = ?", (name,)).fetchone()
        return Tenant(row["name"], row["created_at"]) if row else None

    def tenants(self) -> list[Tenant]:
        return [Tenant(r["name"], r["created_at"]) for r in self._db.execute("SELECT * FROM tenants ORDER BY name")]

    def delete_tenant(self, name: str) -> list[ModelRecord]:
        """Delete a tenant with its keys and models; returns the models that were deleted."""
        models = self.models(name)
        cur = self._db.execute("DELETE FROM tenants WHERE name = ?", (name,))
        if cur.rowcount == 0:
            raise RegistryError(f"no tenant {name!r}")
        return models

    # ---- quotas --------------------------------------------------------------------------
    def quota_settings(self, tenant: str) -> dict[str, Any]:
        """The quotas the operator set for `tenant` (the rest: the service's defaults)."""
        row = self._db.execute("SELECT settings FROM tenant_quotas WHERE tenant = ?", (tenant,)).fetchone()
        return json.loads(row["settings"]) if row else {}

    def tenant_admissions(self) -> dict[str, str]:
        """Each tenant's default admission choice for its models, where the operator set one."""
        return {r["tenant"]: r["admission"] for r in self._db.execute("SELECT tenant, admission FROM tenant_admission")}

    def set_tenant_admission(self, tenant: str, admission: str | None) -> None:
        """Set (None: clear) `tenant`'s default admission choice (mesh.policy.dispatch_rules.ADMISSIONS)."""
        if self.tenant(tenant) is None:
            raise RegistryError(f"no tenant {tenant!r}")
        if admission is None:
            self._db.execute("DELETE FROM tenant_admission WHERE tenant = ?", (tenant,))
            return
        self._db.execute("INSERT INTO tenant_admission (tenant, admission) VALUES (?, ?) "
                         "ON CONFLICT(tenant) DO UPDATE SET admission = excluded.admission", (tenant, admission))

    def set_quota_settings(self, tenant: str, settings: dict[str, Any]) -> None:
        if self.tenant(tenant) is None:
            raise RegistryError(f"no tenant {tenant!r}")
        self._db.execute("INSERT INTO tenant_quotas (tenant, settings) VALUES (?, ?) "
                         "ON CONFLICT(tenant) DO UPDATE SET settings = excluded.settings",
                         (tenant, json.dumps(settings, sort_keys=True)))

    def usage(self, tenant: str) -> tuple[int, int]:
        """(models, bytes of their weights) that `tenant` has registered, its adapters counted as models."""
        row = self._db.execute(
            "SELECT COUNT(*) AS n, COALESCE(SUM(weight_bytes), 0) AS b FROM (SELECT weight_bytes FROM models "
            "WHERE tenant = ? UNION ALL SELECT weight_bytes FROM adapters WHERE tenant = ?)",
            (tenant, tenant)).fetchone()
        return int(row["n"]), int(row["b"])

    # ---- keys ----------------------------------------------------------------------------
    def add_key(self, tenant: str, key_hash: str, display: str, label: str = "") -> KeyInfo:
        if self.tenant(tenant) is None:
            raise RegistryError(f"no tenant {tenant!r}")
        key_id = "key_" + secrets.token_hex(8)
        self._db.execute("INSERT INTO api_keys (id, tenant, key_hash, display, label) VALUES (?, ?, ?, ?, ?)",
                         (key_id, tenant, key_hash, display, label))
        return self.key(key_id)

    def key(self, key_id: str) -> KeyInfo | None:
        row = self._db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return _key(row) if row else None

    def keys(self, tenant: str) -> list[KeyInfo]:
        rows = self._db.execute("SELECT * FROM api_keys WHERE tenant = ? ORDER BY created_at, id", (tenant,))
        return [_key(r) for r in rows]

    def revoke_key(self, key_id: str) -> KeyInfo:
        cur = self._db.execute(
            "UPDATE api_keys SET revoked_at = CAST(strftime('%s','now') AS INTEGER) "
            "WHERE id = ? AND revoked_at IS NULL", (key_id,))
        info = self.key(key_id)
        if info is None:
            raise RegistryError(f"no API key {key_id!r}")
        if cur.rowcount == 0 and info.revoked_at is None:
            raise RegistryError(f"API key {key_id!r} could not be revoked")
        return info

    def tenant_for_key_hash(self, key_hash: str) -> str | None:
        row = self._db.execute("SELECT tenant FROM api_keys WHERE key_hash = ? AND revoked_at IS NULL",
                               (key_hash,)).fetchone()
        return row["tenant"] if row else None

    # ---- models --------------------------------------------------------------------------
    def add_model(self, record: ModelRecord) -> ModelRecord:
        if not MODEL_NAME.match(record.name) or ".." in record.name or "//" in record.name:
            raise RegistryError("model names are 1-128 characters: letters, digits, '_', '.', ':', '/', '-', "
                                "starting with a letter or digit, without '..' or '//'")
        if self.tenant(record.tenant) is None:
            raise RegistryError(f"no tenant {record.tenant!r}")
        if self.adapter(record.tenant, record.name) is not None:
            raise RegistryError(f"model {record.name!r} already exists for tenant {record.tenant!r} (an adapter)")
        slo = record.slo
        try:
            self._db.execute(
                "INSERT INTO models (uid, tenant, name, kind, path, owned_file, sha256, weight_bytes, context_length, "
                "ttft_min_s, ttft_s_per_prompt_token, tpot_s, sampling_defaults, cold_start, admission) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.uid, record.tenant, record.name, record.kind, record.path, int(record.owned_file),
                 record.sha256, record.weight_bytes, record.context_length, slo.ttft_min_s,
                 slo.ttft_s_per_prompt_token, slo.tpot_s, json.dumps(record.sampling_defaults or {}),
                 record.cold_start, record.admission))
        except sqlite3.IntegrityError as exc:
            raise RegistryError(f"model {record.name!r} already exists for tenant {record.tenant!r}") from exc
        return self.model(record.tenant, record.name)

    def model(self, tenant: str, name: str) -> ModelRecord | None:
        row = self._db.execute("SELECT * FROM models WHERE tenant = ? AND name = ?", (tenant, name)).fetchone()
        return _model(row, self.prepared(row["uid"])) if row else None

    def model_by_uid(self, uid: str) -> ModelRecord | None:
        row = self._db.execute("SELECT * FROM models WHERE uid = ?", (uid,)).fetchone()
        return _model(row, self.prepared(uid)) if row else None

    def max_context_length(self, tenant: str) -> int:
        """The largest context window of the tenant's models (0 when it has none)."""
        row = self._db.execute("SELECT MAX(context_length) FROM models WHERE tenant = ?", (tenant,)).fetchone()
        return int(row[0] or 0)

    def models(self, tenant: str | None = None) -> list[ModelRecord]:
        if tenant is None:
            rows = self._db.execute("SELECT * FROM models ORDER BY tenant, name").fetchall()
        else:
            rows = self._db.execute("SELECT * FROM models WHERE tenant = ? ORDER BY name", (tenant,)).fetchall()
        prepared: dict[str, list[PreparedFormat]] = {}
        for r in self._db.execute("SELECT * FROM prepared_formats ORDER BY model_uid, node_kind"):
            prepared.setdefault(r["model_uid"], []).append(_prepared(r))
        return [_model(r, prepared.get(r["uid"], ())) for r in rows]

    # ---- prepared formats ----------------------------------------------------------------
    def prepared(self, uid: str) -> tuple[PreparedFormat, ...]:
        rows = self._db.execute("SELECT * FROM prepared_formats WHERE model_uid = ? ORDER BY node_kind", (uid,))
        return tuple(_prepared(r) for r in rows)

    def set_prepared(self, uid: str, prepared: PreparedFormat) -> bool:
        """Record the state of a model's prepared format (one per node kind); False if the
        model is gone (deleted while its format was being prepared)."""
        try:
            self._db.execute(
                "INSERT INTO prepared_formats (model_uid, node_kind, format, path, state, reason, weight_bytes, "
                "seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(model_uid, node_kind) DO UPDATE SET "
                "format = excluded.format, path = excluded.path, state = excluded.state, reason = excluded.reason, "
                "weight_bytes = excluded.weight_bytes, seconds = excluded.seconds, "
                "updated_at = CAST(strftime('%s','now') AS INTEGER)",
                (uid, prepared.node_kind, prepared.format, prepared.path, prepared.state, prepared.reason,
                 prepared.weight_bytes, prepared.seconds))
        except sqlite3.IntegrityError:  # the model was deleted meanwhile (foreign key)
            return False
        return True

    def set_sampling_defaults(self, uid: str, defaults: dict[str, Any]) -> None:
        self._db.execute("UPDATE models SET sampling_defaults = ? WHERE uid = ?", (json.dumps(defaults), uid))

    def delete_model(self, tenant: str, name: str) -> ModelRecord | None:
        record = self.model(tenant, name)
        if record is not None:
            self._db.execute("DELETE FROM models WHERE uid = ?", (record.uid,))
        return record

    # ---- LoRA adapters -----------------------------------------------------------------------
    def add_adapter(self, record: AdapterRecord) -> AdapterRecord:
        """Store an adapter; RegistryError if the tenant has a model or an adapter of that name."""
        if self.model(record.tenant, record.name) is not None:
            raise RegistryError(f"model {record.name!r} already exists for tenant {record.tenant!r}")
        try:
            self._db.execute("INSERT INTO adapters (uid, tenant, name, base_uid, path, rank, scale, weight_bytes) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (record.uid, record.tenant, record.name, record.base_uid, record.path, record.rank,
                              record.scale, record.weight_bytes))
        except sqlite3.IntegrityError as exc:
            raise RegistryError(f"model {record.name!r} already exists for tenant {record.tenant!r}") from exc
        stored = self.adapter(record.tenant, record.name)
        assert stored is not None
        return stored

    def adapter(self, tenant: str, name: str) -> AdapterRecord | None:
        row = self._db.execute("SELECT * FROM adapters WHERE tenant = ? AND name = ?", (tenant, name)).fetchone()
        return _adapter(row) if row else None

    def adapters(self, tenant: str | None = None) -> list[AdapterRecord]:
        """The tenant's adapters (every tenant's: None), by tenant and name."""
        if tenant is None:
            rows = self._db.execute("SELECT * FROM adapters ORDER BY tenant, name").fetchall()
        else:
            rows = self._db.execute("SELECT * FROM adapters WHERE tenant = ? ORDER BY name", (tenant,)).fetchall()
        return [_adapter(r) for r in rows]

    def delete_adapter(self, tenant: str, name: str) -> AdapterRecord | None:
        record = self.adapter(tenant, name)
        if record is not None:
            self._db.execute("DELETE FROM adapters WHERE uid = ?", (record.uid,))
        return record

    def now(self) -> int:
        """The database's clock, in Unix seconds (for fields like OpenAI's `created`)."""
        return int(self._db.execute("SELECT CAST(strftime('%s','now') AS INTEGER)").fetchone()[0])

    def __iter__(self) -> Iterator[ModelRecord]:
        return iter(self.models())


def new_model_uid() -> str:
    return "m_" + secrets.token_hex(8)


def _key(row: sqlite3.Row) -> KeyInfo:
    return KeyInfo(row["id"], row["tenant"], row["display"], row["label"], row["created_at"], row["revoked_at"])


def _adapter(row: sqlite3.Row) -> AdapterRecord:
    return AdapterRecord(row["uid"], row["tenant"], row["name"], row["base_uid"], row["path"], row["rank"],
                         row["scale"], row["weight_bytes"], row["created_at"])


def _prepared(row: sqlite3.Row) -> PreparedFormat:
    return PreparedFormat(row["node_kind"], row["format"], row["path"], row["state"], row["reason"],
                          row["weight_bytes"], row["seconds"], row["updated_at"])


def _model(row: sqlite3.Row, prepared: tuple[PreparedFormat, ...] | list[PreparedFormat] = ()) -> ModelRecord:
    return ModelRecord(
        uid=row["uid"], tenant=row["tenant"], name=row["name"], kind=row["kind"], path=row["path"],
        context_length=row["context_length"],
        slo=SLO(row["ttft_min_s"], row["ttft_s_per_prompt_token"], row["tpot_s"]),
        weight_bytes=row["weight_bytes"], sha256=row["sha256"], owned_file=bool(row["owned_file"]),
        created_at=row["created_at"], sampling_defaults=json.loads(row["sampling_defaults"] or "{}"),
        prepared=tuple(prepared), cold_start=row["cold_start"], admission=row["admission"],
    )
