"""Request fields that only some engine kinds honour (logprobs, penalties): the dispatcher
places such a request only on nodes whose engine does, and the service answers 400 naming the
field where no node kind of the cluster can (mesh.modelfiles.formats.ENGINE_FEATURES)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from cluster_doubles import build, config, request, spec
from mesh.control.fleet import unable_nodes
from mesh.engines.engine_api import Sampling
from mesh.modelfiles.formats import unhonoured
from mesh.replay.virtual_loop import run_virtual
from mesh.service.errors import ApiError
from mesh.service.request_path import RequestPath
from mesh.wire.served_request import Outcome


def test_features_are_the_fields_a_request_uses():
    assert Sampling().features() == frozenset()
    assert Sampling(logprobs=True, presence_penalty=0.5, repetition_penalty=1.2).features() == {
        "logprobs", "presence_penalty", "repetition_penalty"}
    assert Sampling(frequency_penalty=-1).features() == {"frequency_penalty"}
    assert unhonoured("openvino", Sampling(logprobs=True, frequency_penalty=1).features()) == frozenset()
    assert unhonoured("vllm", Sampling(logprobs=True).features()) == {"logprobs"}
    assert unhonoured("emulated", Sampling(presence_penalty=1).features()) == {"presence_penalty"}


def _scored(req):
    req.engine_request.sampling = replace(req.engine_request.sampling, logprobs=True)
    return req


def test_a_request_with_logprobs_never_goes_to_a_gpu_node():
    """The model's CPU profile cannot meet the TTFT SLO, so a plain request goes to the GPU
    node; the same request asking for logprobs (which the vLLM node does not give) is never
    placed there."""
    async def main():
        catalog = {"slow-cpu": spec("slow-cpu", cpu_prefill_base=30.0)}
        cluster, d = await build("mesh", {"m": "slow-cpu"}, config(cpu=1, gpu=1), catalog)
        plain, scored = request("plain", "m", prompt=100, out=3), _scored(request("scored", "m", prompt=100, out=3))
        assert unable_nodes(cluster.nodes, [plain]) == frozenset()
        assert unable_nodes(cluster.nodes, [scored]) == {"gpu0"}
        d.submit(plain)
        d.submit(scored)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return plain, scored

    plain, scored = run_virtual(main())
    assert plain.outcome is Outcome.COMPLETED and plain.node_id == "gpu0"
    assert scored.node_id != "gpu0" and scored.outcome is not Outcome.COMPLETED


def _path(kinds: list[str]) -> SimpleNamespace:
    nodes = [SimpleNamespace(node_id=f"{k}{i}", kind=k) for i, k in enumerate(kinds)]
    return SimpleNamespace(cluster=SimpleNamespace(nodes=nodes),
                           dispatcher=SimpleNamespace(policy=SimpleNamespace(kinds=("cpu", "gpu"))))


def _job(model_kind: str, sampling: Sampling) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(kind=model_kind, name="acme/m"), sampling=sampling)


@pytest.mark.parametrize("kinds,model_kind,sampling,param", [
    (["gpu"], "hf", Sampling(logprobs=True), "logprobs"),
    (["gpu", "gpu"], "gguf", Sampling(presence_penalty=1.0), "presence_penalty"),
    (["cpu"], "emulated", Sampling(repetition_penalty=1.3), "repetition_penalty"),
])
def test_a_field_no_node_kind_honours_is_a_400_naming_it(kinds, model_kind, sampling, param):
    with pytest.raises(ApiError) as err:
        RequestPath._check_features(_path(kinds), _job(model_kind, sampling))
    assert err.value.status == 400 and err.value.param == param and f"'{param}'" in err.value.message


@pytest.mark.parametrize("kinds,model_kind,sampling", [
    (["cpu", "gpu"], "gguf", Sampling(logprobs=True, frequency_penalty=0.5)),
    (["gpu"], "hf", Sampling()),
    (["cpu"], "emulated", Sampling(temperature=1.0)),
])
def test_a_field_some_node_kind_honours_passes(kinds, model_kind, sampling):
    RequestPath._check_features(_path(kinds), _job(model_kind, sampling))


def test_structured_output_asked_by_tool_choice_is_a_400_naming_tool_choice():
    job = SimpleNamespace(model=SimpleNamespace(kind="gguf", name="acme/m"), schema_param="tool_choice",
                          sampling=Sampling(json_schema='{"type": "object"}'))
    with pytest.raises(ApiError) as err:
        RequestPath._check_features(_path(["gpu"]), job)
    assert err.value.param == "tool_choice" and "'tool_choice'" in err.value.message
    RequestPath._check_features(_path(["cpu", "gpu"]), job)
