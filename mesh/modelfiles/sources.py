"""Model sources: paths under the allowed folder, and what a path holds.

`resolve_allowed(allowed_dir, given, tenant)` accepts a path only if it stays inside the
allowed folder, and for a tenant inside its own folder `<allowed_dir>/<tenant>/` (relative
paths are relative to that folder; the operator's are relative to the allowed folder): no
`..` component, no absolute path elsewhere, and after following every symlink (of the path
and, for a folder, of each file in it) the real path is still inside. For a tenant, every
such refusal and a path that does not exist raise the same SourceNotFound, whose message
names nothing: another tenant's file, a link that leaves the folder and a missing file
cannot be told apart (no existence oracle).
`inspect_source(path)` tells a GGUF file, an OpenVINO IR folder and a Hugging Face folder
apart and reads the model's trained context window and weight size without loading it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mesh.modelfiles.gguf import GGUF_MAGIC


class SourceError(ValueError):
    """A model source path or file was refused; the message says why (safe to show)."""


class SourceNotFound(SourceError):
    """No model at the given path that the caller may register (a 404)."""


# A tenant's answer for a path it may not register or that does not exist: one text, naming
# neither the path nor why, so that it tells nothing about the allowed folder.
TENANT_NOT_FOUND = ("No model file or folder at that path in your folder of the server's allowed folder "
                    "(<allowed-dir>/<your tenant>/; paths are relative to it). Ask the operator to put the model "
                    "there, or upload a GGUF file with Content-Type: application/octet-stream.")


def resolve_allowed(allowed_dir: str | Path | None, given: str, tenant: str | None = None) -> Path:
    """The real path of `given`, relative to the allowed folder (or absolute inside it); with
    `tenant`, relative to (or absolute inside) the tenant's folder `<allowed_dir>/<tenant>`,
    and every refusal below that depends on the file system is TENANT_NOT_FOUND."""
    if allowed_dir is None:
        raise SourceError("this server registers no paths (start it with --allowed-dir DIR); upload the file instead")
    if not isinstance(given, str) or not given.strip() or "\x00" in given:
        raise SourceError("'path' must be a non-empty string")
    allowed = Path(os.path.realpath(allowed_dir))
    if tenant is None:
        return _resolve_in(allowed, given, _operator_refusal)
    if not tenant or "/" in tenant or tenant in (".", ".."):  # registry.TENANT_NAME admits none of these
        raise SourceNotFound(TENANT_NOT_FOUND)
    root = Path(os.path.realpath(allowed / tenant))
    if not _inside(root, allowed) or root == allowed:  # the tenant's folder is a link out of the allowed one
        raise SourceNotFound(TENANT_NOT_FOUND)
    return _resolve_in(root, given, _tenant_refusal)


def _operator_refusal(why: str, given: str, entry: Path | None = None) -> SourceError:
    return {"dotdot": SourceError("'path' may not contain '..'"),
            "outside": SourceError("'path' must be inside the server's allowed folder (symlinks included)"),
            "missing": SourceNotFound(f"'{given}' does not exist in the allowed folder"),
            "link": SourceError(f"'{given}' holds a link that leaves the allowed folder ({entry})")}[why]


def _tenant_refusal(why: str, given: str, entry: Path | None = None) -> SourceError:
    return SourceNotFound(TENANT_NOT_FOUND)


def _resolve_in(root: Path, given: str, refusal: Callable[..., SourceError]) -> Path:
    raw = Path(given)
    if ".." in raw.parts:
        raise refusal("dotdot", given)
    candidate = raw if raw.is_absolute() else root / raw
    real = Path(os.path.realpath(candidate))
    if not _inside(real, root):
        raise refusal("outside", given)
    if not real.exists():
        raise refusal("missing", given)
    if real.is_dir():
        for entry in real.rglob("*"):
            if not _inside(Path(os.path.realpath(entry)), root):
                raise refusal("link", given, entry.relative_to(real))
    return real


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass(frozen=True, slots=True)
class SourceInfo:
    kind: str  # "gguf", "ir", "hf"
    path: Path
    context_length: int  # the model's trained window (0 when unknown)
    weight_bytes: int
    sampling_defaults: dict[str, float] | None = None  # what the model recommends (mesh.modelfiles.sampling)


def inspect_source(path: Path) -> SourceInfo:
    """What model `path` holds; SourceError for anything that is not a model Mesh can read."""
    from mesh.modelfiles.gguf import read_gguf_metadata
    from mesh.modelfiles.sampling import from_generation_config, from_gguf_metadata
    from mesh.modelfiles.shape import shape_from_gguf

    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise SourceError("the file is not a GGUF model (no GGUF magic); pass a GGUF file, an OpenVINO IR "
                                  "folder or a Hugging Face folder")
        try:
            shape = shape_from_gguf(path)
            sampling = from_gguf_metadata(read_gguf_metadata(path))
        except Exception as exc:  # noqa: BLE001 - any parse failure is the file's fault
            raise SourceError(f"cannot read the GGUF header: {exc}") from exc
        return SourceInfo("gguf", path, int(shape.context_length or 0), path.stat().st_size, sampling)
    if not path.is_dir():
        raise SourceError("the path is neither a file nor a folder")
    config = path / "config.json"
    if (path / "openvino_model.xml").is_file():
        missing = [n for n in ("openvino_model.bin", "openvino_tokenizer.xml", "openvino_detokenizer.xml",
                               "config.json") if not (path / n).is_file()]
        if missing:
            raise SourceError(f"the OpenVINO IR folder lacks {', '.join(missing)}; export it again with optimum-cli")
        return SourceInfo("ir", path, _config_window(config), (path / "openvino_model.bin").stat().st_size,
                          from_generation_config(path))
    if config.is_file():
        weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) or sum(
            p.stat().st_size for p in path.glob("*.bin"))
        if not weights:
            raise SourceError("the Hugging Face folder holds no weights (*.safetensors or *.bin)")
        return SourceInfo("hf", path, _config_window(config), weights, from_generation_config(path))
    raise SourceError("the folder is neither an OpenVINO IR folder (openvino_model.xml) nor a Hugging Face "
                      "folder (config.json)")


def _config_window(config: Path) -> int:
    try:
        data = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SourceError(f"config.json is unreadable: {exc}") from exc
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    value = text.get("max_position_embeddings") or text.get("n_positions") or 0
    return int(value) if isinstance(value, int) else 0
