"""Drop parsing: the example drops, normalisation, and each kind of bad input."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest

from tuner.question import drop as drop_mod
from tuner.memory.devices import Device
from tuner.question.drop import DROP_FIELDS, Candidates, Constraints, Drop, load_drop, parse_drop
from tuner.errors import DeviceError, DropError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "configs" / "examples"

MINIMAL = """\
name: t
model: meta-llama/Llama-3.1-8B-Instruct
device: H100-80GB
candidates:
  gpu_memory_utilization: [0.9]
"""


def parse(text: str) -> Drop:
    return parse_drop(textwrap.dedent(text), "/drops/t.yaml")


def bad(text: str) -> DropError:
    with pytest.raises(DropError) as exc:
        parse(text)
    assert exc.value.path == "/drops/t.yaml"
    return exc.value


# --- the example drops -------------------------------------------------------------------------


def test_example_drops_exist():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert {"llama-3.1-8b-h100.yaml", "llama-3.1-8b-rtx3090-v0.yaml", "llama-3.1-70b-h100-tp4.yaml"} <= set(names)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_parses_and_its_model_config_exists(path):
    d = load_drop(path)
    assert d.name == path.stem
    assert d.content_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    mp = d.model_path()
    assert mp is not None and (mp / "config.json").is_file()
    cfg = json.loads((mp / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    json.dumps(d.to_dict())  # JSON-serialisable


def test_example_8b_h100():
    d = load_drop(EXAMPLES / "llama-3.1-8b-h100.yaml")
    assert d.device == "H100-80GB"
    assert d.resolve_device().total_memory_bytes == 85_030_076_416
    assert d.engine_version == "0.19.0"
    assert d.max_num_batched_tokens == 8192 and d.max_num_seqs == 1024
    assert d.candidates.gpu_memory_utilization == (0.8, 0.9, 0.95)
    assert d.candidates.max_model_len == tuple(range(8192, 131072 + 1, 8192))
    assert len(d.candidates.max_model_len) == 16 and d.candidates.max_model_len[-1] == 131072
    assert d.model_path() == (ROOT / "configs/models/meta-llama--Llama-3.1-8B-Instruct").resolve()
    assert d.method == "simulate" and d.dtype == "auto" and d.entry_point == "serve"
    assert d.tensor_parallel_size == 1 and d.constraints == Constraints(1.0, None)


def test_example_8b_rtx3090_v0():
    d = load_drop(EXAMPLES / "llama-3.1-8b-rtx3090-v0.yaml")
    assert d.engine_version == "0.6.4"
    assert d.resolve_device().total_memory_bytes == 25_318_916_096
    assert d.candidates == Candidates((0.9,), (20000, 29000, 35000))


def test_example_70b_tp4():
    d = load_drop(EXAMPLES / "llama-3.1-70b-h100-tp4.yaml")
    assert d.tensor_parallel_size == 4 and d.pipeline_parallel_size == 1
    cfg = json.loads((d.model_path() / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (80, 8192, 8)


def test_model_configs_hold_the_documented_facts():
    cfg = json.loads((ROOT / "configs/models/meta-llama--Llama-3.1-8B-Instruct/config.json").read_text())
    assert cfg["hidden_size"] == 4096 and cfg["num_hidden_layers"] == 32
    assert cfg["num_attention_heads"] == 32 and cfg["num_key_value_heads"] == 8
    assert cfg["intermediate_size"] == 14336 and cfg["vocab_size"] == 128256
    assert cfg["max_position_embeddings"] == 131072 and cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == [128001, 128008, 128009] and cfg["bos_token_id"] == 128000
    big = json.loads((ROOT / "configs/models/meta-llama--Llama-3.1-70B/config.json").read_text())
    assert (big["num_attention_heads"], big["intermediate_size"], big["vocab_size"]) == (64, 28672, 128256)
    assert big["rope_scaling"] == cfg["rope_scaling"]


# --- normalisation ------------------------------------------------------------------------------


def test_minimal_defaults():
    d = parse(MINIMAL)
    assert d == Drop(name="t", model="meta-llama/Llama-3.1-8B-Instruct", device="H100-80GB",
                     candidates=Candidates((0.9,), None), path="/drops/t.yaml",
                     content_sha256=hashlib.sha256(MINIMAL.encode()).hexdigest())
    assert d.engine_version == "0.34.0" and d.method == "simulate" and d.kv_cache_dtype == "auto"
    assert d.quantization is None and d.max_num_seqs is None and d.block_size is None
    assert d.enable_chunked_prefill is None and d.enforce_eager is False
    assert d.model_path() is None  # an HF id that is not a local path


def test_values_are_normalised():
    text = MINIMAL.replace("[0.9]", "[0.95, 0.9, 0.9, 1]\n  max_model_len: [4096, 1024, 4096]")
    d = parse(text + textwrap.dedent("""\
        dtype: BF16
        kv_cache_dtype: FP8
        quantization: AWQ
        method: cuda
        block_size: 32
        enable_chunked_prefill: false
        entry_point: offline
        constraints: {min_concurrency: 2, max_model_len_cap: 65536}
        """))
    assert d.candidates.gpu_memory_utilization == (0.9, 0.95, 1.0)
    assert d.candidates.max_model_len == (1024, 4096)
    assert (d.dtype, d.kv_cache_dtype, d.quantization, d.method) == ("bfloat16", "fp8", "awq", "cuda")
    assert (d.block_size, d.enable_chunked_prefill, d.entry_point) == (32, False, "offline")
    assert d.constraints == Constraints(2.0, 65536)
    out = d.to_dict()
    assert out["candidates"] == {"gpu_memory_utilization": [0.9, 0.95, 1.0], "max_model_len": [1024, 4096]}
    assert out["constraints"] == {"min_concurrency": 2.0, "max_model_len_cap": 65536, "risk": "safe"}
    assert json.loads(json.dumps(out)) == out


@pytest.mark.parametrize(("given", "normal"), [("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"),
                                               ("fp32", "float32"), ("float", "float32"), ("auto", "auto")])
def test_dtype_aliases(given, normal):
    assert parse(MINIMAL + f"dtype: {given}\n").dtype == normal


def test_range_not_landing_on_max():
    d = parse(MINIMAL.replace("[0.9]", "[0.9]\n  max_model_len: {min: 1000, max: 3500, step: 1000}"))
    assert d.candidates.max_model_len == (1000, 2000, 3000)


def test_auto_device_stays_unresolved_and_mapping_device():
    d = parse(MINIMAL.replace("H100-80GB", "auto"))
    assert d.device == "auto"
    with pytest.raises(DeviceError):
        d.resolve_device(nvml=_failing_nvml())
    d = parse(MINIMAL.replace("H100-80GB", "{name: lab-card, total_memory_gib: 23.58}"))
    assert d.device == {"name": "lab-card", "total_memory_gib": 23.58}
    assert d.resolve_device() == Device("lab-card", 25_318_832_210, "given in drop")
    assert d.to_dict()["device"] == {"name": "lab-card", "total_memory_gib": 23.58}


def _failing_nvml():
    import types

    import pynvml

    def init():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    return types.SimpleNamespace(NVMLError=pynvml.NVMLError, nvmlInit=init, nvmlShutdown=lambda: None)


def test_model_paths_resolve_against_drop_directory(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    (tmp_path / "conf.d").mkdir()
    f = tmp_path / "conf.d" / "a.yaml"
    f.write_text(MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", "../models/m"))
    assert load_drop(f).model_path() == tmp_path / "models" / "m"
    f.write_text(MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", "../models/m/config.json"))
    assert load_drop(f).model_path() == tmp_path / "models" / "m" / "config.json"
    # an id-shaped value that exists next to the drop is a local path
    (tmp_path / "conf.d" / "org" / "name").mkdir(parents=True)
    f.write_text(MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", "org/name"))
    assert load_drop(f).model_path() == tmp_path / "conf.d" / "org" / "name"
    f.write_text(MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", str(tmp_path / "models" / "m")))
    assert load_drop(f).model_path() == tmp_path / "models" / "m"


def test_content_sha256_of_raw_bytes(tmp_path):
    f = tmp_path / "a.yaml"
    raw = MINIMAL.encode() + b"# caf\xc3\xa9\r\n"
    f.write_bytes(raw)
    assert load_drop(f).content_sha256 == hashlib.sha256(raw).hexdigest()


def test_yaml_anchors_within_limits_are_fine():
    d = parse(MINIMAL.replace("[0.9]", "&g [0.9]") + "constraints: {min_concurrency: 1}\n")
    assert d.candidates.gpu_memory_utilization == (0.9,)


# --- bad input -> DropError with the right field ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        # document-level
        ("name: [unclosed\n", None, "not valid YAML"),
        ("- a\n- b\n", None, "top level must be a mapping"),
        ("", None, "empty"),
        ("# only a comment\n", None, "empty"),
        ("just a string\n", None, "top level must be a mapping"),
        ("---\nname: a\n---\nname: b\n", None, "not valid YAML"),
        # keys
        (MINIMAL + "colour: red\n", "colour", "unknown key 'colour'"),
        (MINIMAL.replace("candidates:\n", "candidates:\n  gpu_util: [0.5]\n"), "candidates.gpu_util", "unknown key"),
        (MINIMAL + "constraints: {min_concurency: 2}\n", "constraints.min_concurency", "unknown key"),
        (MINIMAL + "1: x\n", "1", "keys must be strings"),
        (MINIMAL + "name: again\n", "name", "duplicate key"),
        (MINIMAL + "trust_remote_code: true\n", "trust_remote_code", "set by the daemon's settings"),
        # required
        (MINIMAL.replace("model: meta-llama/Llama-3.1-8B-Instruct\n", ""), "model", "missing"),
        (MINIMAL.replace("name: t\n", ""), "name", "missing"),
        (MINIMAL.replace("device: H100-80GB\n", ""), "device", "missing"),
        ("name: t\nmodel: a/b\ndevice: T4\n", "candidates.gpu_memory_utilization", "missing"),
        (MINIMAL.replace("model: meta-llama/Llama-3.1-8B-Instruct", "model:"), "model", "null"),
        # name
        (MINIMAL.replace("name: t", "name: 'my drop'"), "name", "A–Z"),
        (MINIMAL.replace("name: t", "name: '..'"), "name", "only dots"),
        (MINIMAL.replace("name: t", "name: " + "a" * 129), "name", "1–128"),
        (MINIMAL.replace("name: t", "name: 12"), "name", "must be a string"),
        # model
        (MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", "'org/..'"), "model", "HF id"),
        (MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", "'org/a..b'"), "model", "HF id"),
        (MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", '"a/b\\0c"'), "model", "NUL"),
        (MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", "42"), "model", "must be a string"),
        (MINIMAL.replace("meta-llama/Llama-3.1-8B-Instruct", "''"), "model", "empty"),
        # device
        (MINIMAL.replace("H100-80GB", "GTX-1080"), "device", "known devices: H100-80GB"),
        (MINIMAL.replace("H100-80GB", "{name: x}"), "device", "total_memory_gib"),
        (MINIMAL.replace("H100-80GB", "{total_memory_gib: 20}"), "device.name", "needs 'name'"),
        (MINIMAL.replace("H100-80GB", "{name: x, total_memory_gib: '80'}"), "device.total_memory_gib", "number"),
        (MINIMAL.replace("H100-80GB", "{name: x, total_memory_gib: -1}"), "device.total_memory_gib", "outside"),
        (MINIMAL.replace("H100-80GB", "{name: x, total_memory_bytes: 1.5}"), "device.total_memory_bytes", "integer"),
        (MINIMAL.replace("H100-80GB", "{name: x, total_memory_gib: 8, vram: 8}"), "device.vram", "unknown key"),
        (MINIMAL.replace("H100-80GB", "[H100-80GB, A100-40GB]"), "device", "one card per pipeline stage"),
        (MINIMAL.replace("H100-80GB", "[]"), "device", "1–64 entries"),
        (MINIMAL.replace("H100-80GB", "[H100-80GB, 3]"), "device[1]", "device name"),
        # engine_version
        (MINIMAL + "engine_version: '0.2.0'\n", "engine_version", "outside"),
        (MINIMAL + "engine_version: banana\n", "engine_version", "cannot parse"),
        (MINIMAL + "engine_version: 0.10\n", "engine_version", "quoted string"),
        # enums
        (MINIMAL + "dtype: int8\n", "dtype", "must be one of"),
        (MINIMAL + "kv_cache_dtype: int4\n", "kv_cache_dtype", "invalid choice"),
        (MINIMAL + "method: guess\n", "method", "must be one of"),
        (MINIMAL + "entry_point: api\n", "entry_point", "must be one of"),
        (MINIMAL + "block_size: 24\n", "block_size", "must be one of"),
        (MINIMAL + "block_size: true\n", "block_size", "must be one of"),
        (MINIMAL + "quantization: 'a b'\n", "quantization", "quantization name"),
        # ints and bools
        (MINIMAL + "tensor_parallel_size: true\n", "tensor_parallel_size", "integer"),
        (MINIMAL + "tensor_parallel_size: 2.0\n", "tensor_parallel_size", "integer"),
        (MINIMAL + "tensor_parallel_size: '2'\n", "tensor_parallel_size", "integer"),
        (MINIMAL + "tensor_parallel_size: 0\n", "tensor_parallel_size", "between 1 and 64"),
        (MINIMAL + "pipeline_parallel_size: 65\n", "pipeline_parallel_size", "between 1 and 64"),
        (MINIMAL + "max_num_seqs: 65537\n", "max_num_seqs", "between 1 and 65536"),
        (MINIMAL + "max_num_batched_tokens: 2097153\n", "max_num_batched_tokens", "between"),
        (MINIMAL + "enforce_eager: 'yes'\n", "enforce_eager", "true or false"),
        (MINIMAL + "enforce_eager: null\n", "enforce_eager", "true or false"),
        (MINIMAL + "enable_chunked_prefill: 1\n", "enable_chunked_prefill", "true or false"),
        # candidates
        # a scalar is taken as a one-element list (issue 31); a boolean or mapping is not
        (MINIMAL.replace("[0.9]", "true"), "candidates.gpu_memory_utilization", "list"),
        (MINIMAL.replace("[0.9]", "1.5"), "candidates.gpu_memory_utilization[0]", "(0, 1]"),
        (MINIMAL.replace("[0.9]", "[]"), "candidates.gpu_memory_utilization", "1–64"),
        (MINIMAL.replace("[0.9]", "[0.5, 0.7, 0]"), "candidates.gpu_memory_utilization[2]", "(0, 1]"),
        (MINIMAL.replace("[0.9]", "[1.5]"), "candidates.gpu_memory_utilization[0]", "(0, 1]"),
        (MINIMAL.replace("[0.9]", "[0.9, true]"), "candidates.gpu_memory_utilization[1]", "number"),
        (MINIMAL.replace("[0.9]", "[.nan]"), "candidates.gpu_memory_utilization[0]", "number"),
        (MINIMAL.replace("[0.9]", "[" + ", ".join(f"0.{i:03d}" for i in range(1, 66)) + "]"),
         "candidates.gpu_memory_utilization", "1–64"),
        (MINIMAL + "  max_model_len: [4096, -8192]\n", "candidates.max_model_len[1]", "between 1 and"),
        (MINIMAL + "  max_model_len: [4096, 16777217]\n", "candidates.max_model_len[1]", "between 1 and"),
        (MINIMAL + "  max_model_len: [4096.0]\n", "candidates.max_model_len[0]", "integer"),
        (MINIMAL + "  max_model_len: [true]\n", "candidates.max_model_len[0]", "integer"),
        (MINIMAL + "  max_model_len: []\n", "candidates.max_model_len", "1–4096"),
        (MINIMAL + "  max_model_len: true\n", "candidates.max_model_len", "list of integers"),
        (MINIMAL + "  max_model_len: {min: 9000, max: 8000, step: 1}\n", "candidates.max_model_len.min",
         "greater than max"),
        (MINIMAL + "  max_model_len: {min: 1, max: 100000, step: 1}\n", "candidates.max_model_len.step",
         "at most 4096"),
        (MINIMAL + "  max_model_len: {min: 1, max: 100000}\n", "candidates.max_model_len.step", "needs 'step'"),
        (MINIMAL + "  max_model_len: {min: 1, max: 10, step: 0}\n", "candidates.max_model_len.step", "between"),
        (MINIMAL + "  max_model_len: {min: 1, max: 10, step: 1, by: 2}\n", "candidates.max_model_len.by",
         "unknown key"),
        (MINIMAL.replace("candidates:\n  gpu_memory_utilization: [0.9]\n", "candidates: [0.9]\n"),
         "candidates", "must be a mapping"),
        # constraints
        (MINIMAL + "constraints: {min_concurrency: 0.5}\n", "constraints.min_concurrency", "between 1"),
        (MINIMAL + "constraints: {min_concurrency: false}\n", "constraints.min_concurrency", "number"),
        (MINIMAL + "constraints: {max_model_len_cap: 0}\n", "constraints.max_model_len_cap", "between 1"),
        (MINIMAL + "constraints: 3\n", "constraints", "must be a mapping"),
    ],
)
def test_bad_drop(text, field, words):
    err = bad(text)
    assert err.field == field
    assert words in err.message, err.message
    if field:
        assert f"/drops/t.yaml:{field}" in str(err)


def test_too_many_max_model_len_values():
    err = bad(MINIMAL + "  max_model_len: [" + ", ".join(str(i) for i in range(1, 4098)) + "]\n")
    assert err.field == "candidates.max_model_len" and "1–4096" in err.message


def test_yaml_bomb_billion_laughs():
    bomb = textwrap.dedent("""\
        a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
        b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
        c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
        d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
        e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
        f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
        g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
        """)
    err = bad(bomb)
    assert err.field is None and "YAML bomb" in err.message


def test_yaml_bomb_few_aliases_large_expansion():
    # 5 levels x 10 aliases = 50 alias references (under the alias limit), 10^5 values expanded.
    lines = ["l0: &l0 [" + ", ".join(["x"] * 10) + "]"]
    for i in range(1, 6):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    err = bad("\n".join(lines) + "\n")
    assert err.field is None and "after alias expansion" in err.message


def test_yaml_recursive_anchor():
    err = bad("name: &n [*n]\n")
    assert err.field is None and "recursive" in err.message


def test_yaml_deep_nesting():
    err = bad("name: " + "[" * 5000 + "]" * 5000 + "\n")
    assert err.field is None and "YAML bomb" in err.message


def test_file_over_256_kib(tmp_path):
    f = tmp_path / "big.yaml"
    f.write_text(MINIMAL + "#" * (256 * 1024) + "\n")
    with pytest.raises(DropError) as exc:
        load_drop(f)
    assert exc.value.path == str(f) and exc.value.field is None and "256 KiB" in exc.value.message


def test_unreadable_and_non_utf8(tmp_path):
    with pytest.raises(DropError, match="cannot read drop"):
        load_drop(tmp_path / "missing.yaml")
    f = tmp_path / "latin1.yaml"
    f.write_bytes(MINIMAL.encode() + b"# caf\xe9\n")
    with pytest.raises(DropError, match="not UTF-8"):
        load_drop(f)


def test_python_tags_are_refused():
    err = bad("name: !!python/object/apply:os.system ['true']\n")
    assert err.field is None and "not valid YAML" in err.message


# --- the field table ----------------------------------------------------------------------------


def test_every_field_is_documented():
    assert len({f.name for f in DROP_FIELDS}) == len(DROP_FIELDS)
    for f in DROP_FIELDS:
        assert f.help.strip(), f"{f.name} has no help"
        assert f.type.strip(), f"{f.name} has no type"
    table = drop_mod.fields_markdown()
    for f in DROP_FIELDS:
        assert f"`{f.name}`" in table


def test_field_table_matches_the_dataclasses():
    top = {f.name for f in DROP_FIELDS if "." not in f.name}
    dataclass_fields = set(Drop.__dataclass_fields__) - {"candidates", "constraints", "path", "content_sha256",
                                                         "release_assumed"}
    assert top == dataclass_fields
    assert {f.name.split(".")[1] for f in DROP_FIELDS if f.name.startswith("candidates.")} == set(
        Candidates.__dataclass_fields__)
    assert {f.name.split(".")[1] for f in DROP_FIELDS if f.name.startswith("constraints.")} == set(
        Constraints.__dataclass_fields__)


def test_table_defaults_are_the_parsed_defaults():
    d = parse(MINIMAL)
    for f in DROP_FIELDS:
        if f.required:
            continue
        section, _, key = f.name.rpartition(".")
        value = getattr(getattr(d, section), key) if section else getattr(d, key)
        if f.name == "engine_version":  # null = resolved at parse time, said in release_assumed (issue 29)
            assert value == d.release_assumed["value"], f.name
            continue
        assert value == f.default, f.name
