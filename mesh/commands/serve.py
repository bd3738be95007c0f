"""`mesh serve`: the control service and node agents for the local CPU (docs/service.md)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from mesh.control.schedulers import POLICIES
from mesh.policy.dispatch_rules import ADMISSIONS
from mesh.policy.queueing import DEFAULT_QUEUE_CAPACITY, DEFAULT_QUEUE_TIMEOUT_S
from mesh.policy.slo import DeadlineRule
from mesh.service.config import quota_value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve tenants' models over REST and the OpenAI API")
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--data-dir", default=None, help="registry and uploads (default: Mesh's data folder)")
    parser.add_argument("--config", default=None, help="a TOML or JSON file of settings (docs/service.md)")
    parser.add_argument("--demo", action="store_true", default=None,
                        help="register the SmolLM2 demo model as demo/smollm2 for tenant demo; print a key")
    parser.add_argument("--allowed-dir", default=None,
                        help="folder under which models may be registered by path: a tenant only in DIR/<tenant>/, the "
                             "operator (admin token) anywhere")
    parser.add_argument("--max-body-mb", type=float, default=None, help="limit of JSON request bodies (default 8)")
    parser.add_argument("--max-upload-mb", type=float, default=None, help="limit of model uploads (default 16384)")
    parser.add_argument("--keep-alive", type=float, default=None, dest="keep_alive_s",
                        help="seconds an idle instance stays loaded (default 60)")
    parser.add_argument("--cpu-memory-gb", type=float, default=None,
                        help="memory budget of the CPU node for weights and KV (default: half of RAM)")
    parser.add_argument("--cpu-nodes", type=int, default=None,
                        help="CPU node agents to run on this machine (default 1); models reach them by multicast")
    parser.add_argument("--node-cores", default=None, metavar="SETS",
                        help="the cores of each local node agent and its engines: '0;1' (in node order: cpu-0, "
                             "cpu-1, ..., vllm-cpu-0) or 'cpu-0=0-3;cpu-1=4-7;service=8'; default: with two or more "
                             "local nodes, the machine's cores split evenly among them, one kept for the service "
                             "where each node still gets two (docs/service.md)")
    parser.add_argument("--remote-agent", action="append", dest="remote_agents", metavar="ID=HOST:PORT",
                        help="a node agent on another machine (`python -m mesh.agent --listen 0.0.0.0:PORT "
                             "--node-id ID --weights-listen 0.0.0.0:PORT2 ...`), same MESH_AGENT_TOKEN and "
                             "MESH_WEIGHTS_TOKEN in both environments; repeat for several")
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="auto|ADDRESS",
                        help="run the node agents on a Ray cluster's machines, one per Ray node and per GPU "
                             "(`ray start --head` here, `ray start --address ...` on the others; "
                             "docs/cluster.md); bare --ray means auto")
    parser.add_argument("--ray-autoscale", action="store_true", default=None,
                        help="with --ray: ask Ray's autoscaler for the nodes Mesh uses and release idle ones")
    parser.add_argument("--weights-plan", choices=("naive", "chain", "binomial"), default=None,
                        help="multicast plan that sends a model to the nodes that start it (default binomial)")
    parser.add_argument("--deadlines", choices=[r.value for r in DeadlineRule], default=None,
                        help="when a request's tokens after the first are due: 'eq1' (default), the paper's Eq. 1, "
                             "from its arrival; 'pace', from its first token, so admission protects the pace "
                             "clients measure and turns more requests away (docs/design.md)")
    parser.add_argument("--policy", default=None, choices=tuple(POLICIES),
                        help="the cluster dispatcher's placement policy, as `mesh replay` evaluates it: "
                             + "; ".join(f"{p.name}: {p.description}" for p in POLICIES.values()) + " (default mesh)")
    parser.add_argument("--queue-capacity", type=int, default=None, dest="queue_capacity",
                        help=f"requests the dispatcher's waiting queue holds across tenants (default "
                             f"{DEFAULT_QUEUE_CAPACITY}); past it a "
                             "request is turned away (429)")
    parser.add_argument("--queue-timeout", default=None, dest="queue_timeout_s", type=_queue_timeout,
                        help="seconds a request may wait for capacity, or 'slo': until it can no longer meet its "
                             f"SLO (default {DEFAULT_QUEUE_TIMEOUT_S:g}); Mesh also turns a request away at once when "
                             f"it cannot meet its SLO")
    parser.add_argument("--admission", default=None, choices=ADMISSIONS,
                        help="what a request that can no longer meet its SLO gets, for models registered without "
                             "their own choice: 'reject' turns it away (429 with the reason and Retry-After, "
                             "LLM-Mesh's rule), 'queue' keeps it waiting up to --queue-timeout and serves it late, "
                             "'late' the same with no time bound (default: queue with --demo, else reject; "
                             "docs/service.md, \"Admission\")")
    parser.add_argument("--watchdog-min-s", type=float, default=None, dest="watchdog_min_s",
                        help="the node agents' engine watchdog: an iteration running past max(this, 20 x its "
                             "predicted time) has hung; its instance fails, its worker is killed, its requests "
                             "move to another instance (default 30)")
    parser.add_argument("--cold-start-s", type=float, default=None, dest="cold_start_s",
                        help="a new instance's start-up besides moving its weights, counted in the TTFT of the "
                             "requests it is started for (default 7.5: the demo model on a 2-core node)")
    parser.add_argument("--exact-moves", action="store_true", default=None, dest="exact_moves",
                        help="CPU instances compute in f32 without dynamic quantization, so a stream moved to "
                             "another node continues exactly as it would have (greedy output identical); about 2x "
                             "the compute (default off: a moved stream loses nothing but may differ at a near-tie)")
    parser.add_argument("--drain-timeout", type=float, default=None, dest="drain_timeout_s",
                        help="seconds shutdown waits for open streams (default 30)")
    parser.add_argument("--profile-dir", default=None, help="calibration profiles, <dir>/<model uid>.json")
    parser.add_argument("--log-level", default=None, help="WARNING (default), INFO, DEBUG")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve HTTPS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--quota-models", type=quota_value(int), default=None,
                        help="default per-tenant quota: models (default 100; 'none': no limit)")
    parser.add_argument("--quota-model-gb", type=quota_value(float), default=None,
                        help="default per-tenant quota: GiB of registered model weights (default 256; 'none')")
    parser.add_argument("--quota-concurrent-requests", type=quota_value(int), default=None,
                        help="default per-tenant quota: open generation requests (default 1024; 'none')")
    parser.add_argument("--quota-requests-per-s", type=quota_value(float), default=None,
                        help="default per-tenant quota: generation requests per second, a token bucket "
                             "(default 1000; 'none')")
    parser.add_argument("--quota-burst", type=quota_value(int), default=None,
                        help="bucket size of --quota-requests-per-s (default 2000; 'none': one second's worth)")
    parser.add_argument("--no-prepare", action="store_false", default=None, dest="prepare_formats",
                        help="do not prepare models' formats for the other kind of node (by default a GGUF is also "
                             "converted to a Hugging Face folder for GPU nodes when there is one; docs/service.md)")
    parser.add_argument("--emulate", metavar="DEVICE:N,...", default=None,
                        help="run N emulated nodes of each profiled device instead of this machine's, e.g. "
                             "xeon-6462c:4,a100-80gb:4: real node agents whose engines take the device's profile "
                             "times; the operator registers emulated models by catalog name (docs/service.md)")
    parser.add_argument("--emulate-weights", default=None,
                        choices=("cached", "ssd", "host", "multicast", "multicast-live"),
                        help="where emulated nodes' loads get their weights, as `mesh replay --weights`: cached "
                             "(host memory), ssd, host, multicast, or multicast-live (a new instance serves before "
                             "its last layer, ZigZag with a full one; docs/multicast.md) (default: cached)")
    parser.add_argument("--vllm-cpu", action="store_true",
                        help="also start a vLLM-on-CPU node agent (tests the GPU path without a GPU; "
                             "same as MESH_VLLM_CPU_NODE=1; needs .venv-vllm from scripts/setup.sh)")
    parser.set_defaults(func=run)


def _queue_timeout(text: str) -> float | str:
    """`--queue-timeout`: seconds, or 'slo' (the config turns it into None)."""
    if text.strip().lower() == "slo":
        return "slo"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'slo', got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    import os

    from mesh.paths import data_dir
    from mesh.service.app import run_service
    from mesh.service.config import ConfigError, build_config, read_config_file

    cli = {k: getattr(args, k) for k in ("host", "port", "data_dir", "demo", "allowed_dir", "max_body_mb",
                                         "max_upload_mb", "keep_alive_s", "cpu_memory_gb", "cpu_nodes", "node_cores",
                                         "remote_agents", "ray", "ray_autoscale",
                                         "weights_plan", "deadlines", "policy", "cold_start_s", "exact_moves",
                                         "drain_timeout_s",
                                         "profile_dir", "log_level", "tls_cert", "tls_key", "quota_models",
                                         "quota_model_gb", "quota_concurrent_requests", "quota_requests_per_s",
                                         "quota_burst", "prepare_formats", "queue_capacity", "queue_timeout_s",
                                         "admission", "emulate", "emulate_weights", "watchdog_min_s")}
    try:
        file_values = read_config_file(args.config) if args.config else {}
        config = build_config(file_values, cli)
    except ConfigError as exc:
        print(f"mesh serve: {exc}", file=sys.stderr)
        return 2
    if config.data_dir is None:
        config.data_dir = data_dir()
    if args.vllm_cpu:
        os.environ["MESH_VLLM_CPU_NODE"] = "1"  # read by mesh.control.vllm_nodes
    logging.basicConfig(level=config.log_level, format="mesh serve: %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run_service(config, ready=lambda line: print(line, flush=True)))
    except KeyboardInterrupt:
        return 130
