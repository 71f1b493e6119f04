"""Helpers for tests/test_vllm_kv_suite.py: locate the records, build ctx-tuner specs from a
record's spec dicts, and compare results with a record's ``expected`` spec dicts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tuner.memory.eras import parse_version
from tuner.memory.kvcache import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HiddenStateSpec,
    KVCacheGroup,
    MambaSpec,
    MLAAttentionSpec,
    mla_spec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

REPO = Path(__file__).resolve().parents[1]
RECORDS_NAME = "cases/vllm-kv-tests.jsonl"


class NotModelled(Exception):
    """The record needs a spec kind ctx-tuner does not model (the test skips it)."""


def records_path() -> Path | None:
    """``$CTX_TUNER_SHARED/cases/…`` if set, else ``<repo>/../shared/cases/…``."""
    env = os.environ.get("CTX_TUNER_SHARED")
    candidates = [Path(env) / RECORDS_NAME] if env else []
    candidates.append(REPO.parent / "shared" / RECORDS_NAME)
    for c in candidates:
        if c.is_file():
            return c
    return None


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_version(rec: dict) -> str:
    """``"0.10.1.1 (PyPI sdist …)"`` → ``"0.10.1.1"`` (validated by the era parser)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+){1,3})", rec["vllm_version_or_commit"])
    assert m, rec["vllm_version_or_commit"]
    parse_version(m.group(1))
    return m.group(1)


def record_function(rec: dict) -> str:
    return rec["id"].split("[", 1)[0]


_DT = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int8": 1, "float8_e4m3fn": 1}


def _dt(d: dict) -> int:
    if "dtype_bytes" in d and not isinstance(d["dtype_bytes"], list):
        return d["dtype_bytes"]
    return _DT[d["dtype"]]


def build_spec(d: dict, version: str | None = None):
    """A record spec dict → ctx-tuner spec object (``version`` picks release-dependent sizing)."""
    k = d["kind"]
    common = dict(block_size=d["block_size"])
    if k == "full":
        return FullAttentionSpec(d["block_size"], d["num_kv_heads"], d["head_size"], _dt(d),
                                 sliding_window=d.get("sliding_window"),
                                 attention_chunk_size=d.get("attention_chunk_size"),
                                 page_size_padded=d.get("page_size_padded"),
                                 max_tp_shards=d.get("max_tp_shards"),
                                 dcp_sharded=d.get("dcp_sharded", True),
                                 kv_quant_mode=d.get("kv_quant_mode"))
    if k == "sliding_window":
        return SlidingWindowSpec(d["block_size"], d["num_kv_heads"], d["head_size"], _dt(d), d["sliding_window"],
                                 page_size_padded=d.get("page_size_padded"), max_tp_shards=d.get("max_tp_shards"),
                                 dcp_sharded=d.get("dcp_sharded", True))
    if k == "chunked_local":
        return ChunkedLocalAttentionSpec(d["block_size"], d["num_kv_heads"], d["head_size"], _dt(d),
                                         d["attention_chunk_size"], page_size_padded=d.get("page_size_padded"))
    if k == "mla":
        if d.get("block_stride_alignment") or d.get("tokens_per_state"):
            raise NotModelled("MLA block-stride alignment / indexer states")
        return mla_spec(version or "0.19.0", d["block_size"], d["head_size"], _dt(d), num_kv_heads=d["num_kv_heads"],
                        cache_dtype_str=d.get("cache_dtype_str"), max_tp_shards=d.get("max_tp_shards"),
                        dcp_sharded=d.get("dcp_sharded", True))
    if k == "sliding_window_mla":
        return SlidingWindowMLASpec(d["block_size"], d["num_kv_heads"], d["head_size"], _dt(d), d["sliding_window"],
                                    max_tp_shards=d.get("max_tp_shards"))
    if k == "hidden_state":
        return HiddenStateSpec(d["block_size"], d["num_kv_heads"], d["head_size"], _dt(d))
    if k == "mamba":
        dts = d["dtype_bytes"] if isinstance(d.get("dtype_bytes"), list) else [_DT[x] for x in d["dtypes"]]
        mode = d.get("mamba_cache_mode")
        return MambaSpec(d["block_size"], tuple(tuple(s) for s in d["shapes"]), tuple(dts),
                         page_size_padded=d.get("page_size_padded"),
                         num_speculative_blocks=d.get("num_speculative_blocks", 0),
                         mamba_cache_mode=None if mode in (None, "none") else mode)
    if k == "uniform_type":
        return UniformTypeKVCacheSpecs(d["block_size"], {n: build_spec(s, version) for n, s in d["per_layer"].items()})
    raise NotModelled(f"spec kind {k!r}")


def build_layers(layers: list[dict], version: str | None = None) -> dict:
    return {layer["name"]: build_spec(layer["spec"], version) for layer in layers}


def layers_from_count(d: dict, version: str | None = None) -> dict:
    """``{"count": 32, "spec": …, "names"?: …}`` → layer dict."""
    spec = build_spec(d["spec"], version)
    names = d.get("names") or [f"layer_{i}" for i in range(d["count"])]
    return {n: spec for n in names}


_KIND = {FullAttentionSpec: "full", SlidingWindowSpec: "sliding_window", ChunkedLocalAttentionSpec: "chunked_local",
         MLAAttentionSpec: "mla", MambaSpec: "mamba", UniformTypeKVCacheSpecs: "uniform_type",
         SlidingWindowMLASpec: "sliding_window_mla", HiddenStateSpec: "hidden_state"}


def assert_spec(actual, exp: dict, where: str = "") -> None:
    """Compare a ctx-tuner spec with a record's spec dict, field by field."""
    if "kind" in exp:
        assert _KIND[type(actual)] == exp["kind"], f"{where}: kind {_KIND[type(actual)]} != {exp['kind']}"
    if "page_size_bytes" in exp:
        assert actual.page_size_bytes == exp["page_size_bytes"], f"{where}: page {actual.page_size_bytes} != {exp}"
    if exp.get("kind") == "uniform_type":
        assert list(actual.kv_cache_specs) == list(exp["per_layer"]), where
        for n, s in exp["per_layer"].items():
            assert_spec(actual.kv_cache_specs[n], s, f"{where}/{n}")
        assert actual.block_size == exp["block_size"], where
        return
    for key in ("block_size", "num_kv_heads", "head_size", "sliding_window", "attention_chunk_size",
                "page_size_padded", "cache_dtype_str", "num_speculative_blocks", "max_tp_shards", "dcp_sharded"):
        if key in exp:
            assert getattr(actual, key, None) == exp[key], f"{where}: {key} {getattr(actual, key, None)} != {exp[key]}"
    if "dtype" in exp or "dtype_bytes" in exp:
        if not isinstance(actual, MambaSpec):
            assert actual.dtype_bytes == _dt(exp), f"{where}: dtype"


def assert_groups(groups: list[KVCacheGroup], exp: list[dict], where: str = "groups") -> None:
    assert len(groups) == len(exp), f"{where}: {len(groups)} groups != {len(exp)}"
    for i, (g, e) in enumerate(zip(groups, exp)):
        if isinstance(e["layer_names"], list):
            assert g.layer_names == e["layer_names"], f"{where}[{i}]: {g.layer_names} != {e['layer_names']}"
        elif "num_layers" in e:
            assert len(g.layer_names) == e["num_layers"]
        if "spec" in e:
            assert_spec(g.spec, e["spec"], f"{where}[{i}]")


def assert_tensors(tensors, exp: list[dict], where: str = "tensors") -> None:
    assert len(tensors) == len(exp), f"{where}: {len(tensors)} != {len(exp)}"
    for i, (t, e) in enumerate(zip(tensors, exp)):
        assert t.size_bytes == e["size_bytes"], f"{where}[{i}] size {t.size_bytes} != {e['size_bytes']}"
        names = e.get("shared_by", e.get("layers"))
        assert t.shared_by == names, f"{where}[{i}] layers {t.shared_by} != {names}"
        for key in ("layer_stride_bytes", "block_stride_bytes", "offset_bytes"):
            if key in e:
                assert getattr(t, key) == e[key], f"{where}[{i}] {key} {getattr(t, key)} != {e[key]}"
