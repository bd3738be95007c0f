"""Memory subsystem: KV demand (Eq. 2), watermark scaling (6.2), compromise (6.4)."""
import pytest

from mesh.policy.kv_demand import RunningMean, kv_require_bytes, recommend_bytes, watermark_target
from mesh.policy.memory import InstanceMemory, MemorySubsystem

C = 1000  # bytes per token


def test_eq2_uses_mean_output_and_l_min():
    # sum (I + max(O, O_avg)) = (100 + 50) + (200 + 80) = 430 tokens
    assert kv_require_bytes(C, [(100, 10), (200, 80)], mean_output=50, l_min=0) == 430 * C
    assert kv_require_bytes(C, [(100, 10)], mean_output=50, l_min=4096) == 4096 * C
    assert kv_require_bytes(C, [], mean_output=50, l_min=512) == 512 * C


def test_watermark_scales_up_early_and_down_lazily():
    w = 0.2
    assert watermark_target(current=900, require=1000, watermark=w) == 1200  # M_cur < M_require
    assert watermark_target(current=1000, require=1000, watermark=w) is None
    # Down only when M_recommend * (1 + w) < M_cur: 800 * 1.2 = 960 * 1.2 = 1152
    assert watermark_target(current=1152, require=800, watermark=w) is None
    assert watermark_target(current=1153, require=800, watermark=w) == 960


def test_running_mean_starts_from_prior():
    m = RunningMean(prior=200)
    assert m.value == 200
    m.add(100)
    m.add(300)
    assert m.value == 200 and m.count == 2


def node(capacity: int, l_min: int = 100) -> tuple[MemorySubsystem, InstanceMemory]:
    mem = MemorySubsystem(capacity, watermark=0.2)
    inst = InstanceMemory("i", C, weight_bytes=10_000, l_min=l_min, mean_output=RunningMean(50))
    issued = mem.load(inst)
    assert issued.accepted
    mem.station.complete(issued.op.op_id)
    return mem, inst


def test_load_reserves_weights_and_recommended_floor():
    mem, _ = node(capacity=10**6)
    assert mem.kv_bytes("i") == recommend_bytes(100 * C, 0.2) == 120 * C
    assert mem.kv_capacity_tokens("i") == 120


def test_admission_scales_to_recommend_then_compromises():
    mem, _ = node(capacity=10_000 + 400 * C)
    # demand 100 + 50 + 200 + 50 = 400 tokens: recommend 480 does not fit, require 400 does
    plan = mem.plan_admission("i", [(100, 0), (200, 0)])
    assert plan.ok and plan.compromised and plan.kv_bytes == 400 * C
    plan = mem.plan_admission("i", [(100, 0), (150, 0)])  # 350 -> recommend 420 > 400: compromise
    assert plan.compromised
    plan = mem.plan_admission("i", [(10, 0), (20, 0)])  # 130 tokens -> recommend 156 fits
    assert plan.ok and not plan.compromised and plan.kv_bytes == 156 * C
    plan = mem.plan_admission("i", [(300, 0), (200, 0)])  # 600 tokens: nothing fits
    assert not plan.ok and plan.shortfall_bytes == 200 * C
    assert "short by" in plan.reason()


def test_no_scale_when_current_suffices():
    mem, _ = node(capacity=10**6)
    assert mem.plan_admission("i", [(20, 0)]).kv_bytes is None  # 100 (L_min) <= 120


def test_lazy_scale_down_after_requests_leave():
    mem, _ = node(capacity=10**7)
    issued = mem.resize_kv("i", 1000 * C)
    mem.station.complete(issued.op.op_id)
    assert mem.lazy_scale_down("i", [(700, 100)]) is None  # 750 * 1.2 * 1.2 = 1080 >= 1000
    down = mem.lazy_scale_down("i", [(100, 10)])  # require = max(150, 100) -> 180
    assert down.op.new_bytes - 10_000 == 180 * C


def test_grow_for_underestimate():
    mem, _ = node(capacity=10_000 + 300 * C)
    assert mem.grow_for("i", 100) is None
    issued = mem.grow_for("i", 250)  # recommend 300 fits exactly
    assert issued.accepted and mem.kv_capacity_tokens("i") == 300
    assert not mem.grow_for("i", 301).accepted


def test_unload_frees_everything():
    mem, _ = node(capacity=10**6)
    issued = mem.unload("i")
    mem.station.complete(issued.op.op_id)
    assert mem.station.budget == 0 and "i" not in mem.instances
    with pytest.raises(KeyError):
        mem.kv_bytes("i")
