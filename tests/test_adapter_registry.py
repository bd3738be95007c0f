"""The registry's adapter records (schema 6): next to the models, one namespace with them per
tenant, gone with their base or their tenant, counted in the tenant's usage."""
from __future__ import annotations

import pytest

from mesh.policy.slo import SLO
from mesh.service.registry import AdapterRecord, ModelRecord, Registry, RegistryError


@pytest.fixture
def registry(tmp_path):
    r = Registry(tmp_path / "registry.sqlite3")
    for tenant in ("shared", "acme"):
        r.create_tenant(tenant)
    r.add_model(ModelRecord("m_base", "shared", "llama-1b", "ir", "/ir", 256, SLO(), 1000))
    yield r
    r.close()


def _adapter(name: str = "tune", tenant: str = "acme", uid: str = "a_1") -> AdapterRecord:
    return AdapterRecord(uid, tenant, name, "m_base", f"/allowed/{tenant}/{name}/adapter_model.safetensors", 8, 2.0,
                         50)


def test_an_adapter_is_stored_listed_and_counted(registry):
    stored = registry.add_adapter(_adapter())
    assert (stored.base_uid, stored.rank, stored.scale, stored.weight_bytes) == ("m_base", 8, 2.0, 50)
    assert stored.created_at > 0
    assert registry.adapter("acme", "tune") == stored and registry.adapter("shared", "tune") is None
    assert registry.adapters("acme") == [stored] and registry.adapters() == [stored]
    assert registry.usage("acme") == (1, 50) and registry.usage("shared") == (1, 1000)


def test_models_and_adapters_share_a_tenants_names(registry):
    registry.add_adapter(_adapter())
    with pytest.raises(RegistryError, match="already exists"):
        registry.add_adapter(_adapter(uid="a_2"))
    with pytest.raises(RegistryError, match="already exists"):
        registry.add_model(ModelRecord("m_2", "acme", "tune", "gguf", "/g", 256, SLO(), 1))
    registry.add_model(ModelRecord("m_3", "acme", "own", "gguf", "/g", 256, SLO(), 1))
    with pytest.raises(RegistryError, match="already exists"):
        registry.add_adapter(_adapter("own", uid="a_3"))


def test_an_adapter_goes_with_its_base_and_with_its_tenant(registry):
    registry.add_adapter(_adapter())
    registry.add_adapter(_adapter("other", "shared", "a_2"))
    assert registry.delete_adapter("acme", "nope") is None
    registry.delete_model("shared", "llama-1b")
    assert registry.adapters() == []
    registry.add_model(ModelRecord("m_base", "shared", "llama-1b", "ir", "/ir", 256, SLO(), 1000))
    registry.add_adapter(_adapter())
    registry.delete_tenant("acme")
    assert registry.adapters() == []
