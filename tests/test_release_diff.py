"""tuner.releases.diff on two tiny synthetic vLLM trees (no wheel, no network)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from tuner.releases import diff as rd

OLD_WORKER = '''
class Worker:
    def determine_available_memory(self):
        """Old docstring."""
        return self.requested_memory - self.non_kv  # a comment

    def init_device(self):
        self.snapshot = 1
'''
NEW_WORKER = '''
class Worker:
    def determine_available_memory(self):
        """A rewritten docstring: not a change."""
        # another comment
        return self.requested_memory  -  self.non_kv

    def init_device(self):
        self.snapshot = 2
        self.extra = 3
'''
OLD_CACHE = '''
class CacheConfig:
    DEFAULT_BLOCK_SIZE = 16
    gpu_memory_utilization: float = 0.92
'''
NEW_CACHE = '''
class CacheConfig:
    DEFAULT_BLOCK_SIZE = 64
    DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
    gpu_memory_utilization: float | None = None
'''
OLD_UTILS = '''
def check_enough_kv_cache_memory(cfg, spec, avail):
    return avail > 0

def get_num_blocks(a, b):
    return a // b
'''
NEW_PLANNING = '''
def check_enough_kv_cache_memory(cfg, spec, avail):
    return avail > 0

def get_num_blocks(a, b):
    return a // b

def shrink_kv_cache_configs(cfg, configs, n):
    return n

def measure_memory_after_warmup():
    return 0
'''
OLD_ENVS = '''
environment_variables = {
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": lambda: bool(int(os.getenv("X", "0"))),
}
'''
NEW_ENVS = '''
environment_variables = {
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": lambda: bool(int(os.getenv("X", "1"))),
}
'''
OLD_RUNNER = '''
class GPUModelRunner:
    def profile_run(self):
        pass
'''


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "vllm" / "__init__.py").write_text("")
    return root


@pytest.fixture
def trees(tmp_path):
    old = _tree(tmp_path / "old", {"vllm/v1/worker/gpu_worker.py": OLD_WORKER, "vllm/config/cache.py": OLD_CACHE,
                                   "vllm/v1/core/kv_cache_utils.py": OLD_UTILS, "vllm/envs.py": OLD_ENVS,
                                   "vllm/v1/worker/gpu_model_runner.py": OLD_RUNNER})
    new = _tree(tmp_path / "new", {"vllm/v1/worker/gpu_worker.py": NEW_WORKER, "vllm/config/cache.py": NEW_CACHE,
                                   "vllm/v1/core/kv_cache_planning.py": NEW_PLANNING, "vllm/envs.py": NEW_ENVS})
    return old, new


def _by_key(items):
    return {i.key: i for i in items}


def test_release_diff_ignores_docstrings_comments_and_formatting(trees):
    old, new = trees
    items = _by_key(rd.compare(rd.Release(str(old)), rd.Release(str(new))))
    assert items["worker:Worker.determine_available_memory"].status == "unchanged"
    init = items["worker:Worker.init_device"]
    assert (init.status, init.added, init.removed) == ("changed", 2, 1)


def test_release_diff_defaults_moves_removals_and_dict_entries(trees):
    old, new = trees
    items = _by_key(rd.compare(rd.Release(str(old)), rd.Release(str(new))))
    assert items["cache:CacheConfig.DEFAULT_BLOCK_SIZE"].status == "changed"
    assert items["cache:CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION"].status == "added"
    assert items["cache:CacheConfig.gpu_memory_utilization"].status == "changed"
    moved = items["kv_cache:get_num_blocks"]  # kv_cache_utils.py -> kv_cache_planning.py, same code
    assert moved.status == "unchanged" and moved.moved
    assert moved.file_b == "vllm/v1/core/kv_cache_planning.py"
    assert items["kv_cache:shrink_kv_cache_configs"].status == "added"
    assert items["runner-v1:GPUModelRunner.profile_run"].status == "removed"
    env = items["envs:environment_variables['VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS']"]
    assert (env.status, env.added, env.removed) == ("changed", 1, 1)
    assert items["kv_cache:estimate_max_model_len"].status == "absent"


def test_release_diff_lists_new_memory_sounding_names(trees):
    old, new = trees
    names = rd.new_memory_names(rd.Release(str(old)), rd.Release(str(new)))
    assert names == ["kv_cache_planning.py:measure_memory_after_warmup"]  # shrink_… is tracked already


def test_release_diff_reads_a_wheel_and_prints_the_report(trees, tmp_path, capsys):
    old, new = trees
    whl = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f in new.rglob("*.py"):
            z.write(f, f.relative_to(new).as_posix())
    assert rd.main([str(old), str(whl)]) == 0
    out = capsys.readouterr().out
    assert "changed   cache:CacheConfig.DEFAULT_BLOCK_SIZE" in out
    assert "removed   runner-v1:GPUModelRunner.profile_run" in out
    assert "[defaults]" in out and "+1 -1" in out
    assert rd.main([str(old), str(whl), "--json", "--diff"]) == 0
    doc = json.loads(capsys.readouterr().out)
    init = next(i for i in doc["items"] if i["key"] == "worker:Worker.init_device")
    assert "+    self.extra = 3" in init["diff"]


def test_release_diff_version_goes_through_the_downloader(trees, tmp_path):
    old, new = trees
    whl = tmp_path / "dl" / "vllm-0.99.0-py3-none-any.whl"
    whl.parent.mkdir()
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("vllm/config/cache.py", NEW_CACHE)
    seen = []
    rel = rd.Release("0.99.0", downloader=lambda v, c: seen.append(v) or whl)
    assert seen == ["0.99.0"] and "DEFAULT_BLOCK_SIZE = 64" in rel.read("vllm/config/cache.py")


def test_release_diff_bad_source_is_a_typed_error(tmp_path):
    with pytest.raises(rd.ReleaseDiffError, match="neither a vllm/ tree"):
        rd.Release(str(tmp_path))
    assert rd.main([str(tmp_path), str(tmp_path)]) == 2
