"""`mesh calibrate`: measure an engine's prefill and decode times into a profile file.

    mesh calibrate --engine openvino --model PATH [--quick] [--out FILE]
                   [--max-prompt N] [--max-batch B] [--max-context C] [--reps R] [--warmup W]
    mesh calibrate --gpu-reference [--out FILE] [--python PY] [--quick]

Grids of powers of two (LLM-Mesh 5.2) up to the limits, warm-up and timed repetitions per
point, medians, a progress bar; interrupted runs resume from `<out>.state.json`. See
docs/calibration.md.

--gpu-reference runs the GPU probe instead (mesh/calibration/gpu_probe.py, docs/roofline.md "GPU
reference"), where a CUDA GPU and PyTorch are: a Llama-2-7B-shaped decoder in PyTorch and the
host-to-GPU copies, into the JSON that mesh.perf.gpu_reference fits the GPU roofline to.
"""
from __future__ import annotations

import argparse
import shlex
import sys

DEFAULT_ENGINE = "openvino"
GPU_REFERENCE_OUT = "gpu-probe.json"
_TORCH_CHECK = "import json, torch; print(json.dumps([torch.__version__, torch.cuda.is_available()]))"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure an engine's iteration times into a profile",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=("openvino", "vllm"),
                   help="engine to calibrate (default: openvino)")
    p.add_argument("--model", help="GGUF file or OpenVINO IR folder ('demo' for the cached demo model); "
                                    "required unless --gpu-reference")
    p.add_argument("--gpu-reference", action="store_true",
                   help="run the GPU reference probe (needs PyTorch and a CUDA GPU) into --out "
                        f"(default {GPU_REFERENCE_OUT}); with --quick, its tiny configuration, also on the CPU")
    p.add_argument("--python", metavar="PY", help="--gpu-reference: the interpreter with PyTorch (default: this one)")
    p.add_argument("--name", help="model name in the profile (default: from the file name)")
    p.add_argument("--out", help="profile file to write (default: DATA/profiles/MODEL__DEVICE.json)")
    p.add_argument("--quick", action="store_true",
                   help="small grid for CI: prompts/contexts up to 512, batch up to 8, 3 reps, 1 warm-up")
    p.add_argument("--max-prompt", type=int, help="largest prompt length (full default 2048)")
    p.add_argument("--max-batch", type=int, help="largest decode batch (full default 16)")
    p.add_argument("--max-context", type=int, help="largest mean decode context (full default 2048)")
    p.add_argument("--reps", type=int, help="timed repetitions per point (full default 5)")
    p.add_argument("--warmup", type=int, help="untimed repetitions before them (full default 2)")
    p.add_argument("--passes", type=int,
                   help="measure the whole grid this many times, samples pooled (full default 2, quick 1)")
    p.add_argument("--context-window", type=int,
                   help="engine context window (default: the next power of two above the limits)")
    p.add_argument("--max-wait", type=float, default=120.0, metavar="S",
                   help="on a shared machine: wait up to S seconds in all for other processes to leave the "
                        "CPUs before re-measuring a disturbed point (default 120; 0: never wait)")
    p.add_argument("--restart", action="store_true", help="discard a saved state and measure everything again")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.gpu_reference:
        return gpu_reference(args.out or GPU_REFERENCE_OUT, args.python or sys.executable, tiny=args.quick)
    if not args.model:
        print("mesh calibrate: --model is required (a GGUF file, an OpenVINO IR folder or 'demo'), "
              "unless --gpu-reference", file=sys.stderr)
        return 2
    from mesh.calibration.runner import (
        FULL,
        QUICK,
        CalibrationError,
        Settings,
        calibrate,
        format_heldout,
        state_path_for,
    )
    from mesh.calibration.targets import make_target
    from mesh.modelfiles.demo import ModelFetchError
    from mesh.paths import data_dir

    base = QUICK if args.quick else FULL
    try:
        settings = Settings(
            max_prompt=args.max_prompt or base.max_prompt,
            max_batch=args.max_batch or base.max_batch,
            max_context=args.max_context or base.max_context,
            reps=args.reps if args.reps is not None else base.reps,
            warmup=args.warmup if args.warmup is not None else base.warmup,
            passes=args.passes or base.passes,
        )
        model = _model_path(args.model)
        longest = max(settings.max_prompt, settings.max_context + 1)
        window = args.context_window or _next_power_of_two(longest + 1)
        target = make_target(args.engine, model, context_window=window, max_batch=settings.max_batch,
                             model_name=args.name)
        out = args.out or str(data_dir() / "profiles" / f"{target.model_name}__{target.device}.json")
        command = "mesh calibrate " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
            if sys.argv[1:2] == ["calibrate"] else None
        print(f"calibrating {args.engine} {target.model_name} on {target.device}: prompts up to "
              f"{settings.max_prompt}, batches up to {settings.max_batch}, contexts up to {settings.max_context}, "
              f"{settings.reps} reps after {settings.warmup} warm-up, {settings.passes} pass(es)", file=sys.stderr)
        report = calibrate(target, settings, out, restart=args.restart, progress=not args.no_progress,
                           command=command or f"mesh calibrate --engine {args.engine} --model {args.model}",
                           max_wait_s=args.max_wait)
    except (CalibrationError, ModelFetchError) as exc:
        print(f"mesh calibrate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = state_path_for(out) if "out" in locals() else "the state file"
        print(f"\nmesh calibrate: interrupted; measured points are kept in {where}. Run the same command "
              "again to resume.", file=sys.stderr)
        return 130
    print(format_heldout(report.heldout, report.profile.provenance["calibration"].get("pass_to_pass")))
    print(f"{len(report.profile.prefill_lengths)} prefill and "
          f"{len(report.profile.decode_batches) * len(report.profile.decode_contexts)} decode grid points "
          f"({report.measured_now} measured now, {report.resumed} resumed) in {report.seconds:.1f} s")
    print(f"wrote {report.out}")
    return 0


def gpu_reference(out: str, python: str, tiny: bool = False) -> int:
    """Run mesh/calibration/gpu_probe.py with `python`, after checking that it has PyTorch and
    (unless `tiny`) sees a CUDA GPU; a clear message and exit 2 where it does not."""
    import json
    import os
    import subprocess
    from pathlib import Path

    try:
        done = subprocess.run([python, "-c", _TORCH_CHECK], capture_output=True, text=True, timeout=120)
        version, cuda = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else (None, False)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        done, version, cuda = None, None, False
        print(f"mesh calibrate: cannot run {python}: {exc}", file=sys.stderr)
    if version is None:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1] if done is not None else "it did not run"
        print(f"mesh calibrate --gpu-reference: needs PyTorch, and {python} cannot import torch ({why}). Run it "
              "where a GPU and PyTorch are, or name an interpreter that has them with --python PATH.", file=sys.stderr)
        return 2
    if not cuda and not tiny:
        print(f"mesh calibrate --gpu-reference: no CUDA GPU: torch {version} in {python} sees none "
              "(torch.cuda.is_available() is False). The probe measures a GPU: run it on a machine with one "
              "(--quick runs its tiny configuration on the CPU, to check the probe itself).", file=sys.stderr)
        return 2
    root = str(Path(__file__).resolve().parents[2])  # the checkout, where `python -m mesh...` finds the package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    command = [python, "-m", "mesh.calibration.gpu_probe", "--out", out] + (["--tiny"] if tiny else [])
    rc = subprocess.run(command, env=env).returncode
    if rc == 0:
        print(f"wrote {out}; to fit the roofline to it, copy it into mesh/perf/gpu_reference/ and name it in "
              "mesh.perf.gpu_reference.PROBES beside a HARDWARE entry with the GPU's datasheet peaks "
              "(docs/roofline.md, 'GPU reference')", file=sys.stderr)
    return rc


def _model_path(model: str) -> str:
    if model == "demo":
        from mesh.modelfiles.demo import demo_gguf_path

        return str(demo_gguf_path(fetch=True))
    return model


def _next_power_of_two(n: int) -> int:
    v = 1
    while v < n:
        v *= 2
    return v
