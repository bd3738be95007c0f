"""Profile file format "mesh-profile/1": round trips and every validation error."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from mesh.perf.profile import (
    Profile,
    ProfileError,
    dumps_profile,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    reference_profile,
    reference_profiles,
    save_profile,
)


def small_doc() -> dict:
    return {
        "format": "mesh-profile/1",
        "model": "tiny",
        "device": "test-cpu",
        "device_kind": "cpu",
        "engine": "simulated",
        "kv_bytes_per_token": 1024,
        "weight_bytes": 1_000_000,
        "max_context": 64,
        "prefill": {"prompt_lengths": [16, 32, 64], "seconds": [0.1, 0.2, 0.4]},
        "decode": {
            "batch_sizes": [1, 2, 4, 8],
            "context_lengths": [16, 32, 64],
            "seconds": [
                [0.01, 0.011, 0.012],
                [0.012, 0.013, 0.014],
                [0.014, 0.015, 0.016],
                [0.02, 0.021, 0.022],
            ],
        },
        "provenance": {"method": "measured", "hardware": {"cpu": "test"}, "notes": "unit test"},
    }


def write(tmp_path: Path, doc: dict | str, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=2))
    return path


def error_of(tmp_path: Path, doc: dict | str) -> str:
    path = write(tmp_path, doc)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert message.startswith(str(path) + ": "), message  # always names the file
    return message


def test_load_builds_tuples(tmp_path: Path) -> None:
    p = load_profile(write(tmp_path, small_doc()))
    assert p.model == "tiny" and p.device_kind == "cpu" and p.max_context == 64
    assert p.prefill_lengths == (16, 32, 64) and p.prefill_s == (0.1, 0.2, 0.4)
    assert p.decode_batches == (1, 2, 4, 8) and p.decode_contexts == (16, 32, 64)
    assert p.decode_s[3] == (0.02, 0.021, 0.022)
    assert p.provenance["method"] == "measured"


def test_save_load_round_trip_exact(tmp_path: Path) -> None:
    original = profile_from_dict(small_doc())
    path = tmp_path / "out.json"
    save_profile(original, path)
    again = load_profile(path)
    assert again == original
    assert profile_to_dict(again) == small_doc()
    save_profile(again, tmp_path / "out2.json")
    assert (tmp_path / "out2.json").read_bytes() == path.read_bytes()


def test_round_trip_reference_profiles(tmp_path: Path) -> None:
    for model, device in reference_profiles():
        p = reference_profile(model, device)
        save_profile(p, tmp_path / "r.json")
        assert load_profile(tmp_path / "r.json") == p


def test_pretty_json_keeps_number_lists_on_one_line() -> None:
    doc = small_doc()
    doc["provenance"]["notes"] = "brackets [1,\n 2] inside a string stay as they are"
    text = dumps_profile(profile_from_dict(doc))
    assert '"prompt_lengths": [16, 32, 64],' in text
    assert "[0.01, 0.011, 0.012]," in text
    assert json.loads(text) == doc


def test_profile_built_directly_is_validated_and_normalised() -> None:
    p = profile_from_dict(small_doc())
    q = dataclasses.replace(p, prefill_lengths=[16, 32, 64], decode_s=[list(r) for r in p.decode_s])
    assert q == p and isinstance(q.prefill_lengths, tuple) and isinstance(q.decode_s[0], tuple)
    with pytest.raises(ProfileError, match=r"prefill\.seconds\[1\]: must be a positive number, got -1"):
        dataclasses.replace(p, prefill_s=(0.1, -1.0, 0.3))


def test_source_names_dict_errors() -> None:
    doc = small_doc()
    del doc["model"]
    with pytest.raises(ProfileError, match=r"^mine: model: missing field"):
        profile_from_dict(doc, source="mine")


@pytest.mark.parametrize(
    "field", ["format", "model", "device", "device_kind", "engine", "kv_bytes_per_token",
              "weight_bytes", "max_context", "prefill", "decode", "provenance"],
)
def test_missing_top_level_field(tmp_path: Path, field: str) -> None:
    doc = small_doc()
    del doc[field]
    assert f": {field}: missing field" in error_of(tmp_path, doc)


@pytest.mark.parametrize(
    "section, key", [("prefill", "prompt_lengths"), ("prefill", "seconds"), ("decode", "batch_sizes"),
                     ("decode", "context_lengths"), ("decode", "seconds"), ("provenance", "method"),
                     ("provenance", "hardware")],
)
def test_missing_nested_field(tmp_path: Path, section: str, key: str) -> None:
    doc = small_doc()
    del doc[section][key]
    assert f": {section}.{key}: missing field" in error_of(tmp_path, doc)


def test_decode_row_shorter_than_contexts(tmp_path: Path) -> None:
    doc = small_doc()
    doc["decode"]["seconds"][2] = [0.014, 0.015]
    message = error_of(tmp_path, doc)
    assert "decode.seconds[2]: has 2 times but decode.context_lengths has 3 points" in message


def test_decode_missing_row(tmp_path: Path) -> None:
    doc = small_doc()
    doc["decode"]["seconds"].pop()
    assert "decode.seconds: must be a list of 4 rows (one per batch size), got 3" in error_of(tmp_path, doc)


def test_prefill_seconds_length_mismatch(tmp_path: Path) -> None:
    doc = small_doc()
    doc["prefill"]["seconds"] = [0.1, 0.2]
    assert "prefill.seconds: has 2 times but prefill.prompt_lengths has 3 points" in error_of(tmp_path, doc)


def test_negative_time_names_the_cell(tmp_path: Path) -> None:
    doc = small_doc()
    doc["decode"]["seconds"][3][2] = -0.1
    path = write(tmp_path, doc)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value) == f"{path}: decode.seconds[3][2]: must be a positive number, got -0.1"


@pytest.mark.parametrize("bad", [0, 0.0, -1e-9, float("nan"), float("inf"), "0.1", None, True])
def test_non_positive_or_non_numeric_times(tmp_path: Path, bad: object) -> None:
    doc = small_doc()
    doc["prefill"]["seconds"][1] = bad
    assert "prefill.seconds[1]: must be a positive number" in error_of(tmp_path, doc)


def test_nan_in_the_file_text(tmp_path: Path) -> None:
    text = json.dumps(small_doc()).replace("0.013", "NaN")
    assert "decode.seconds[1][1]: must be a positive number, got nan" in error_of(tmp_path, text)


@pytest.mark.parametrize(
    "axis, values, where, problem",
    [
        ("prompt_lengths", [16, 64, 32], "[2]", "must be greater than the previous point 64"),
        ("prompt_lengths", [16, 16, 32], "[1]", "must be greater than the previous point 16"),
        ("prompt_lengths", [16, 48, 64], "[1]", "must be a positive power of two, got 48"),
        ("prompt_lengths", [0, 32, 64], "[0]", "must be a positive power of two, got 0"),
        ("prompt_lengths", [16.0, 32, 64], "[0]", "must be a positive power of two, got 16.0"),
    ],
)
def test_bad_prefill_axis(tmp_path: Path, axis: str, values: list, where: str, problem: str) -> None:
    doc = small_doc()
    doc["prefill"][axis] = values
    assert f"prefill.{axis}{where}: {problem}" in error_of(tmp_path, doc)


def test_bad_decode_axes(tmp_path: Path) -> None:
    doc = small_doc()
    doc["decode"]["batch_sizes"] = [1, 2, 3, 8]
    assert "decode.batch_sizes[2]: must be a positive power of two, got 3" in error_of(tmp_path, doc)
    doc = small_doc()
    doc["decode"]["context_lengths"] = [32, 16, 64]
    assert "decode.context_lengths[1]: must be greater than the previous point 32" in error_of(tmp_path, doc)


def test_axis_needs_two_points(tmp_path: Path) -> None:
    doc = small_doc()
    doc["prefill"]["prompt_lengths"] = [16]
    doc["prefill"]["seconds"] = [0.1]
    assert "prefill.prompt_lengths: must be a list of at least 2 powers of two" in error_of(tmp_path, doc)


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    text = json.dumps(small_doc(), indent=2).replace('"engine": "simulated",', '"engine": "simulated"')
    message = error_of(tmp_path, text)
    line = next(i for i, text_line in enumerate(text.splitlines(), 1) if '"kv_bytes_per_token"' in text_line)
    assert f": line {line} column" in message and "not valid JSON" in message


def test_wrong_format_tag(tmp_path: Path) -> None:
    doc = small_doc()
    doc["format"] = "mesh-profile/3"
    assert "format: must be one of ('mesh-profile/1', 'mesh-profile/2'), got 'mesh-profile/3'" in error_of(tmp_path,
                                                                                                           doc)


def test_format_2_overheads_round_trip_and_format_1_still_reads(tmp_path: Path) -> None:
    old = load_profile(write(tmp_path, small_doc(), "old.json"))
    assert old.overheads == {} and old.overhead("decode_after_prefill_s") == 0.0
    save_profile(old, tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["format"] == "mesh-profile/1"  # unchanged
    doc = small_doc()
    doc["format"] = "mesh-profile/2"
    doc["overheads"] = {"decode_after_prefill_s": 0.005, "instance_switch_s": 0.0}
    new = load_profile(write(tmp_path, doc, "new.json"))
    assert new.overhead("decode_after_prefill_s") == 0.005 and new.overhead("step_overhead_s") == 0.0
    save_profile(new, tmp_path / "new2.json")
    assert load_profile(tmp_path / "new2.json") == new
    assert json.loads((tmp_path / "new2.json").read_text())["format"] == "mesh-profile/2"


def test_overhead_errors(tmp_path: Path) -> None:
    doc = small_doc()
    doc["overheads"] = {"decode_after_prefill_s": 0.005}
    assert "overheads: needs format 'mesh-profile/2'" in error_of(tmp_path, doc)
    doc["format"] = "mesh-profile/2"
    doc["overheads"] = {"warp_s": 0.1}
    assert "overheads.warp_s: unknown overhead" in error_of(tmp_path, doc)
    doc["overheads"] = {"instance_switch_s": -1}
    assert "overheads.instance_switch_s: must be a number of seconds >= 0, got -1" in error_of(tmp_path, doc)


def test_other_field_errors(tmp_path: Path) -> None:
    cases = [
        (("device_kind", "tpu"), "device_kind: must be one of ('cpu', 'gpu'), got 'tpu'"),
        (("kv_bytes_per_token", 0), "kv_bytes_per_token: must be a positive integer, got 0"),
        (("weight_bytes", 1.5), "weight_bytes: must be a positive integer, got 1.5"),
        (("model", ""), "model: must be a non-empty string"),
        (("prefill", [1, 2]), "prefill: must be a JSON object, got list"),
        (("typo_field", 1), "typo_field: unknown field"),
    ]
    for (key, value), expected in cases:
        doc = small_doc()
        doc[key] = value
        assert expected in error_of(tmp_path, doc), expected
    doc = small_doc()
    doc["provenance"]["method"] = "guessed"
    assert "provenance.method: must be one of ('roofline', 'measured', 'prior')" in error_of(tmp_path, doc)
    doc["provenance"] = {"method": "measured", "hardware": "a box"}
    assert "provenance.hardware: must be a JSON object, got str" in error_of(tmp_path, doc)
    assert "<top level>: must be a JSON object, got list" in error_of(tmp_path, "[1, 2]")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="nope.json: cannot read the profile file"):
        load_profile(tmp_path / "nope.json")


def test_reference_profiles_listed_and_loadable() -> None:
    pairs = reference_profiles()
    assert ("llama-2-7b", "xeon-6462c") in pairs and ("llama-2-13b", "a100-80gb") in pairs
    assert ("llama-2-7b", "h200") in pairs and ("llama-3.2-3b", "h100") in pairs
    assert len(pairs) == 13  # 4 models on the CPU, 3 on each of 3 GPUs
    for model, device in pairs:
        p = reference_profile(model, device)
        assert isinstance(p, Profile) and (p.model, p.device) == (model, device)


def test_unknown_reference_lists_valid_ones() -> None:
    with pytest.raises(ProfileError) as info:
        reference_profile("llama-9-70b", "xeon-6462c")
    message = str(info.value)
    assert "llama-9-70b__xeon-6462c.json" in message and "llama-2-7b/xeon-6462c" in message


def test_provenance_is_copied() -> None:
    doc = small_doc()
    p = profile_from_dict(doc)
    doc["provenance"]["notes"] = "changed"
    assert p.provenance["notes"] == "unit test"
    out = profile_to_dict(p)
    out["provenance"]["hardware"]["cpu"] = "changed"
    assert p.provenance["hardware"]["cpu"] == "test"
    assert copy.deepcopy(p) == p
