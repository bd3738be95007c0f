"""Request fields that only some engine kinds honour (alternatives, `top_logprobs`, only vLLM;
logprobs, penalties and structured output both real engines, not the emulated one): the
dispatcher places such a request only on nodes whose engine does, and the service answers 400
naming the field where no node kind of the cluster can (mesh.modelfiles.formats.ENGINE_FEATURES)."""
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
    assert Sampling(logprobs=True, top_logprobs=3, json_schema="{}").features() == {
        "logprobs", "top_logprobs", "response_format"}
    assert unhonoured("openvino", Sampling(logprobs=True, frequency_penalty=1).features()) == frozenset()
    every = Sampling(logprobs=True, top_logprobs=5, presence_penalty=1, frequency_penalty=1, repetition_penalty=1.2,
                     json_schema="{}").features()
    assert unhonoured("vllm", every) == frozenset()
    assert unhonoured("openvino", every) == {"top_logprobs"}
    assert unhonoured("emulated", Sampling(presence_penalty=1).features()) == {"presence_penalty"}


def _with(req, **sampling):
    req.engine_request.sampling = replace(req.engine_request.sampling, **sampling)
    return req


def test_a_request_for_alternatives_never_goes_to_a_cpu_node():
    """The model's GPU profile cannot meet the TTFT SLO, so a plain request goes to the CPU
    node, and so may one asking for each token's log probability and a penalty (both engines
    honour them); the same request asking for alternatives (which OpenVINO does not give) is
    never placed there."""
    async def main():
        catalog = {"slow-gpu": spec("slow-gpu", gpu_prefill_base=30.0)}
        cluster, d = await build("mesh", {"m": "slow-gpu"}, config(cpu=1, gpu=1), catalog)
        plain = request("plain", "m", prompt=100, out=3)
        scored = _with(request("scored", "m", prompt=100, out=3), logprobs=True, presence_penalty=0.5)
        top = _with(request("top", "m", prompt=100, out=3), logprobs=True, top_logprobs=2)
        assert unable_nodes(cluster.nodes, [plain]) == unable_nodes(cluster.nodes, [scored]) == frozenset()
        assert unable_nodes(cluster.nodes, [top]) == {"cpu0"}
        for r in (plain, scored, top):
            d.submit(r)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return plain, scored, top

    plain, scored, top = run_virtual(main())
    assert plain.outcome is Outcome.COMPLETED and plain.node_id == "cpu0"
    assert scored.outcome is Outcome.COMPLETED and scored.node_id == "cpu0"
    assert top.node_id != "cpu0" and top.outcome is not Outcome.COMPLETED


def _path(kinds: list[str], runnable: tuple[str, ...] = ("cpu", "gpu")) -> SimpleNamespace:
    """A request path's cluster of nodes of `kinds`, where the model has formats for `runnable`."""
    nodes = [SimpleNamespace(node_id=f"{k}{i}", kind=k) for i, k in enumerate(kinds)]
    return SimpleNamespace(cluster=SimpleNamespace(nodes=nodes),
                           dispatcher=SimpleNamespace(policy=SimpleNamespace(kinds=("cpu", "gpu"))),
                           catalogue=SimpleNamespace(runnable_kinds=lambda _record: runnable))


def _job(model_kind: str, sampling: Sampling, chat: bool = True) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(kind=model_kind, name="acme/m"), sampling=sampling,
                           messages=[{"role": "user", "content": "hi"}] if chat else None)


TOP = Sampling(logprobs=True, top_logprobs=3)


@pytest.mark.parametrize("kinds,model_kind,sampling,chat,param", [
    (["cpu"], "gguf", TOP, True, "top_logprobs"),
    (["cpu", "cpu"], "ir", TOP, False, "logprobs"),  # a completion asks for alternatives with its logprobs count
    (["gpu"], "emulated", Sampling(logprobs=True), True, "logprobs"),
    (["gpu", "gpu"], "emulated", Sampling(presence_penalty=1.0), True, "presence_penalty"),
    (["cpu"], "emulated", Sampling(repetition_penalty=1.3), True, "repetition_penalty"),
])
def test_a_field_no_node_kind_honours_is_a_400_naming_it(kinds, model_kind, sampling, chat, param):
    with pytest.raises(ApiError) as err:
        RequestPath._check_features(_path(kinds), _job(model_kind, sampling, chat))
    assert err.value.status == 400 and err.value.param == param and f"'{param}'" in err.value.message


def test_alternatives_for_a_model_no_vllm_node_can_run_yet_are_a_400():
    """A GGUF model without its Hugging Face folder for the GPU nodes (not prepared, or not
    yet): the vLLM node cannot serve it, so alternatives are a 400 there too."""
    with pytest.raises(ApiError) as err:
        RequestPath._check_features(_path(["cpu", "gpu"], runnable=("cpu",)), _job("gguf", TOP))
    assert err.value.param == "top_logprobs" and "(openvino)" in err.value.message
    RequestPath._check_features(_path(["cpu", "gpu"], runnable=("cpu", "gpu")), _job("gguf", TOP))


@pytest.mark.parametrize("kinds,model_kind,sampling", [
    (["cpu", "gpu"], "gguf", Sampling(logprobs=True, frequency_penalty=0.5)),
    (["gpu"], "hf", Sampling(logprobs=True, presence_penalty=1.0, repetition_penalty=1.2, json_schema="{}")),
    (["cpu", "gpu"], "gguf", TOP),
    (["gpu"], "hf", TOP),
    (["gpu"], "hf", Sampling()),
    (["cpu"], "emulated", Sampling(temperature=1.0)),
])
def test_a_field_some_node_kind_honours_passes(kinds, model_kind, sampling):
    RequestPath._check_features(_path(kinds), _job(model_kind, sampling))


def test_structured_output_asked_by_tool_choice_is_a_400_naming_tool_choice():
    """Structured output asked by a required or named `tool_choice`: where no engine of the
    cluster constrains output (an emulated model), the 400 names `tool_choice`."""
    def job(kind: str) -> SimpleNamespace:
        return SimpleNamespace(model=SimpleNamespace(kind=kind, name="acme/m"), schema_param="tool_choice",
                               sampling=Sampling(json_schema='{"type": "object"}'), messages=[])

    with pytest.raises(ApiError) as err:
        RequestPath._check_features(_path(["cpu", "gpu"]), job("emulated"))
    assert err.value.param == "tool_choice" and "'tool_choice'" in err.value.message
    for kinds in (["gpu"], ["cpu"], ["cpu", "gpu"]):  # both engines constrain output
        RequestPath._check_features(_path(kinds), job("gguf"))
