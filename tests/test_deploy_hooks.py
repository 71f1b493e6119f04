"""The pre-commit hook (.pre-commit-hooks.yaml) and the GitHub Action (action.yml) run ``ctx-tuner
check`` on changed deploy files: each is run here on a fixture git repository, as pre-commit and the
Action run it (the hook's entry command on the staged YAML files; the Action's check script on the
diff against the base), without the pre-commit tool or GitHub. Also the shipped install recipes:
the Containerfile the Kubernetes example uses, and no ``pip install ctx-tuner`` anywhere."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

FIX = REPO / "tests" / "fixtures" / "deploy"
CHECK_ARGS = ["--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants",
              "--models-dir", str(REPO / "configs" / "models")]
GIT = shutil.which("git")
pytestmark = pytest.mark.skipif(GIT is None, reason="git not installed")


def _env() -> dict:
    bindir = str(Path(sys.executable).parent)  # the venv's ctx-tuner console script
    return {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([GIT, *args], cwd=repo, env=_env(), check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    r = tmp_path / "ops"
    r.mkdir()
    _git(r, "init", "-q", "-b", "main")
    (r / "README.md").write_text("ops repo\n")
    _git(r, "add", "README.md")
    _git(r, "commit", "-q", "-m", "base")
    return r


def _stage_changes(repo: Path) -> None:
    (repo / "deploy").mkdir()
    shutil.copy(FIX / "k8s-deployment.yaml", repo / "deploy" / "llama.yaml")
    (repo / "deploy" / "service.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: llama}\n")
    (repo / ".github").mkdir()
    (repo / ".github" / "ci.yml").write_text("on: push\njobs: {}\n")
    (repo / "notes.txt").write_text("not yaml\n")
    _git(repo, "add", "-A")


def test_pre_commit_hook_checks_the_staged_deploy_files(repo):
    [hook] = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "ctx-tuner-check" and hook["language"] == "python" and hook["types"] == ["yaml"]
    _stage_changes(repo)
    staged = _git(repo, "diff", "--cached", "--name-only", "--diff-filter=ACMR").split()
    files = [f for f in staged if f.endswith((".yaml", ".yml"))]  # pre-commit's `types: [yaml]`
    assert files == [".github/ci.yml", "deploy/llama.yaml", "deploy/service.yaml"]
    cmd = shlex.split(hook["entry"]) + CHECK_ARGS + files  # entry + args + filenames, as pre-commit runs it
    p = subprocess.run(cmd, cwd=repo, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "== deploy/llama.yaml:Deployment/llama:containers[0].args (k8s, Deployment)" in p.stdout
    assert "DOES NOT START: max_model_len 131072 at gpu_memory_utilization 0.25" in p.stdout
    assert "skipped .github/ci.yml: not a deploy file" in p.stdout
    assert "skipped deploy/service.yaml: no vLLM container found" in p.stdout
    # the fix the hook asks for: the nearest length that starts
    text = (repo / "deploy" / "llama.yaml").read_text().replace('value: "131072"', 'value: "16384"')
    (repo / "deploy" / "llama.yaml").write_text(text)
    p = subprocess.run(cmd, cwd=repo, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "STARTS: max_model_len 16384 at gpu_memory_utilization 0.25" in p.stdout


def _action_script() -> str:
    doc = yaml.safe_load((REPO / "action.yml").read_text())
    assert doc["runs"]["using"] == "composite"
    [step] = [s for s in doc["runs"]["steps"] if s.get("id") == "check"]
    assert set(step["env"]) >= {"CTX_PATHS", "CTX_DEVICE", "CTX_ENGINE_VERSION", "CTX_MODELS_DIR", "CTX_BASE"}
    install = [s for s in doc["runs"]["steps"] if "github.action_path" in str(s.get("run"))]
    assert install and "pip install" in install[0]["run"]  # from the action's own checkout, not an index
    return step["run"]


def test_github_action_checks_the_deploy_files_a_push_changed(repo, tmp_path):
    script = _action_script()
    _stage_changes(repo)
    _git(repo, "commit", "-q", "-m", "deploy llama")
    out = tmp_path / "github_output"
    env = {**_env(), "CTX_PATHS": "*.yaml *.yml", "CTX_DEVICE": "H100-80GB", "CTX_ENGINE_VERSION": "0.19.0",
           "CTX_MODELS_DIR": str(REPO / "configs" / "models"), "CTX_BASE": "", "CTX_ARGS": "--no-variants",
           "GITHUB_OUTPUT": str(out)}
    p = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "deploy/llama.yaml:Deployment/llama:containers[0].args" in p.stdout
    assert out.read_text().strip() == "exit-code=3"
    # a push that changes no YAML passes without running anything
    (repo / "notes.txt").write_text("changed\n")
    _git(repo, "commit", "-q", "-am", "notes")
    p = subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "no changed file matches *.yaml *.yml" in p.stdout


def test_containerfile_installs_the_built_wheel_on_cpu_torch():
    text = (REPO / "Containerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", text, re.M)
    assert [s[1] for s in stages] == ["wheel", ""]
    assert "python -m build --wheel" in text
    assert re.search(r'pip install --no-cache-dir "torch==\$\{TORCH_VERSION\}" --index-url \S+/whl/cpu', text)
    assert "pip install --no-cache-dir /tmp/dist/ctx_tuner-*.whl" in text
    assert re.search(r'^ENTRYPOINT \["ctx-tuner"\]', text, re.M)
    job = [d for d in yaml.safe_load_all((REPO / "configs" / "k8s" / "check-job.yaml").read_text())
           if d["kind"] == "Job"][0]
    [c] = job["spec"]["template"]["spec"]["containers"]
    assert c["image"].endswith("/ctx-tuner:0.1.0") and c["args"][0] == "check" and "command" not in c
    assert "Containerfile" in (REPO / "configs" / "k8s" / "check-job.yaml").read_text()


def test_shipped_examples_ran_pip_install_ctx_tuner_which_no_index_has():
    for p in [REPO / "README.md", *sorted((REPO / "configs").rglob("*.y*ml")), REPO / "action.yml",
              *sorted((REPO / "docs").glob("*.md"))]:
        assert not re.search(r"pip install (-q )?'?ctx-tuner(\[\w+\])?'?(\s|$|&)", p.read_text()), p
