"""``ctx-tuner check`` on deploy files (issue 30): every vLLM workload of a Kubernetes manifest,
``helm template`` output, production-stack or llm-d Helm values, KServe resources, a docker compose
file or a ``vllm serve --config`` YAML gets the same verdict and numbers as its ``vllm serve`` line.
The fixtures in tests/fixtures/deploy/ were written from each format's documentation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._cli_helpers import run_cli as _cli
from tests.conftest import REPO
from tests.test_check import inproc_worker
from tuner.reports.check import run_check

FIX = REPO / "tests" / "fixtures" / "deploy"
MODELS = str(REPO / "configs" / "models")
L8B = "meta-llama/Llama-3.1-8B-Instruct"
#: the line every single-workload fixture deploys: 0.25 of an H100 and 131072 tokens of Llama 3.1 8B
LONG_LINE = ["vllm", "serve", L8B, "--max-model-len", "131072", "--gpu-memory-utilization", "0.25"]


@pytest.fixture(autouse=True)
def _inproc(monkeypatch):
    monkeypatch.setattr("tuner.seam.worker.run_in_worker", inproc_worker)


def serve_line(argv):
    return run_check(list(argv), device="H100-80GB", engine_version="0.19.0", variants=False, models_dir=MODELS)


def deploy(path, *extra):
    rc, out, err = _cli("check", "--json", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants",
                        "--models-dir", MODELS, *extra, str(path))
    return rc, json.loads(out), err


def same_as_line(w: dict, line) -> None:
    """A workload's verdict and numbers are the serve line's."""
    ref = serve_line(line)
    doc = w["check"]
    assert doc is not None, w["error"]
    assert w["exit_code"] == ref.exit_code
    assert doc["verdict"] == ref.doc["verdict"]
    assert doc["engine_error"] == ref.doc["engine_error"]
    assert doc["max_model_len"] == ref.doc["max_model_len"]
    assert doc["gpu_memory_utilization"] == ref.doc["gpu_memory_utilization"]
    for k in ("num_gpu_blocks", "kv_cache_tokens", "available_kv_cache_bytes", "weights_bytes",
              "activation_peak_bytes"):
        assert doc["numbers"][k] == ref.doc["numbers"][k], k
    assert doc["device"]["name"] == "H100-80GB"


FORMATS = [
    ("k8s-deployment.yaml", "k8s", "k8s-deployment.yaml:Deployment/llama:containers[0].args"),
    ("production-stack-values.yaml", "helm",
     "production-stack-values.yaml:servingEngineSpec.modelSpec[0](llama8b).vllmConfig"),
    ("kserve-llminferenceservice.yaml", "kserve",
     "kserve-llminferenceservice.yaml:LLMInferenceService/llama-8b:template:containers[0].command"),
    ("kserve-servingruntime.yaml", "kserve",
     "kserve-servingruntime.yaml:InferenceService/llama+ServingRuntime/vllm-runtime:containers[0].args"),
    ("llm-d-modelservice-values.yaml", "llm-d", "llm-d-modelservice-values.yaml:decode:containers[0].args"),
    ("compose/docker-compose.yaml", "compose", "compose/docker-compose.yaml:services.vllm.command"),
    ("vllm-config.yaml", "vllm-config", "vllm-config.yaml:(vllm serve --config)"),
]


@pytest.mark.parametrize("name,fmt,where", FORMATS, ids=[f[1] + ":" + f[0] for f in FORMATS])
def test_each_format_gives_the_serve_lines_verdict_and_numbers(name, fmt, where, monkeypatch):
    monkeypatch.chdir(FIX)
    rc, doc, err = deploy(name)
    assert rc == 3, err
    [w] = doc["workloads"]
    assert w["where"] == where and w["workload"]["format"] == fmt
    same_as_line(w, LONG_LINE)
    assert w["check"]["numbers"]["num_gpu_blocks"] == 1360  # ~2.66 GiB of KV cache: DOES NOT START (1325 before §24)


def test_file_with_two_workloads_reports_both(monkeypatch):
    monkeypatch.chdir(FIX)
    rc, doc, _ = deploy("helm-template-two-workloads.yaml")
    assert rc == 3 and doc["exit_code"] == 3  # the worst of 0 and 3
    chat, long = doc["workloads"]
    assert chat["where"] == "helm-template-two-workloads.yaml:Deployment/chat:containers[0].args"
    assert long["where"] == "helm-template-two-workloads.yaml:StatefulSet/long-context:containers[0].args"
    assert chat["exit_code"] == 0 and long["exit_code"] == 3
    same_as_line(chat, ["vllm", "serve", L8B, "--max-model-len", "8192", "--gpu-memory-utilization", "0.9"])
    same_as_line(long, ["vllm", "serve", L8B, "--max-model-len", "128K", "--gpu-memory-utilization", "0.25"])
    rc, out, _ = _cli("check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants",
                      "--models-dir", MODELS, "helm-template-two-workloads.yaml")
    assert "== helm-template-two-workloads.yaml:Deployment/chat:containers[0].args" in out
    assert "== helm-template-two-workloads.yaml:StatefulSet/long-context:containers[0].args" in out
    assert out.rstrip().endswith("2 workload(s): 1 start, 1 do not start; exit 3")


def test_check_config_refused_every_deploy_file_with_no_model_specified(monkeypatch):
    """Before: `check --config FILE` read every deploy file as a vLLM config and exited 2 with vLLM's
    "No model specified!". Now --config reads a deploy file as one."""
    monkeypatch.chdir(FIX)
    for name, _, where in FORMATS[:-1] + [("helm-template-two-workloads.yaml", "k8s", "")]:
        rc, out, err = _cli("check", "--json", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants",
                            "--models-dir", MODELS, "--config", name)
        assert "No model specified" not in out + err, name
        assert rc == 3, (name, err)
        assert all(w["check"] is not None for w in json.loads(out)["workloads"])


def test_deployment_gmu_025_131072_on_h100_was_starts(monkeypatch):
    """Before: with --allow-unmodelled the Deployment's keys were skipped as unknown flags and the model
    checked at the default 0.9 and its derived maximum: STARTS, exit 0; the serve line says exit 3."""
    monkeypatch.chdir(FIX)
    rc, doc, _ = deploy("k8s-deployment.yaml", "--allow-unmodelled", "--config")
    assert rc == 3 and doc["workloads"][0]["verdict"] == "does not start"
    assert doc["workloads"][0]["check"]["gpu_memory_utilization"] == 0.25
    assert serve_line(LONG_LINE).exit_code == 3
    # a deploy file given as --config with a serve line is refused, never checked without its arguments
    rc, out, err = _cli("check", "--allow-unmodelled", "--device", "H100-80GB", "--engine-version", "0.19.0",
                        "--models-dir", MODELS, "--config", "k8s-deployment.yaml", "--", "vllm", "serve", L8B)
    assert rc == 2 and "a deploy file, not a `vllm serve --config` YAML" in err


def test_extra_args_win_over_vllm_config_in_production_stack_values(monkeypatch):
    monkeypatch.chdir(FIX)
    _, doc, _ = deploy("production-stack-values.yaml")
    w = doc["workloads"][0]
    assert w["check"]["read"]["values"]["gpu_memory_utilization"] == 0.25  # extraArgs, after vllmConfig's 0.9
    assert w["check"]["read"]["values"]["enable_prefix_caching"] is True
    assert w["workload"]["gpus"] == 1 and w["workload"]["gpu_product"] == "NVIDIA-H100-80GB-HBM3"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


POD = """apiVersion: v1
kind: Pod
metadata: {{name: p}}
spec:
  containers:
    - name: vllm
      image: vllm/vllm-openai:v0.19.0
      args: [{args}]
      env: [{env}]
      resources: {{limits: {{nvidia.com/gpu: {gpus}}}}}
"""


def test_pod_with_fewer_gpus_than_tensor_parallel_does_not_start(tmp_path):
    p = _write(tmp_path, "pod.yaml", POD.format(args=f'"{L8B}", "-tp", "2", "--max-model-len", "8192"', env="",
                                                gpus=1))
    rc, doc, _ = deploy(p)
    w = doc["workloads"][0]
    assert rc == 3 and w["verdict"] == "does not start"
    assert w["check"]["engine_error"].startswith("World size (2) is larger than the number of available GPUs (1) "
                                                 "in this node.")
    assert serve_line(["vllm", "serve", L8B, "-tp", "2", "--max-model-len", "8192"]).exit_code == 0


def test_unknown_vllm_env_is_named_not_modelled_and_exit_2_unless_allowed(tmp_path):
    p = _write(tmp_path, "pod.yaml", POD.format(args=f'"{L8B}", "--max-model-len", "8192"',
                                                env="{name: VLLM_ATTENTION_BACKEND, value: FLASHINFER}", gpus=1))
    rc, doc, _ = deploy(p)
    assert rc == 2 and "VLLM_ATTENTION_BACKEND=FLASHINFER (a vLLM environment variable" in doc["workloads"][0]["error"]
    rc, doc, _ = deploy(p, "--allow-unmodelled")
    assert rc == 0
    [nm] = doc["workloads"][0]["check"]["not_modelled"]
    assert (nm["argument"], nm["value"], nm["source"]) == ("env VLLM_ATTENTION_BACKEND", "FLASHINFER",
                                                          f"{p}:Pod/p:containers[0].args")
    assert "vllm/envs.py" in nm["why"]


def test_not_a_deploy_file_is_exit_2_naming_it(tmp_path):
    p = _write(tmp_path, "x.yaml", "- just\n- a list\n")
    rc, doc, _ = deploy(p)
    assert rc == 2 and doc["workloads"][0]["error"].startswith(f"{p}: not a deploy file")
    q = _write(tmp_path, "svc.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: s}\n")
    rc, doc, _ = deploy(q)
    assert rc == 2 and "no vLLM container found" in doc["workloads"][0]["error"]


def test_worst_exit_precedence():
    from tuner.deploy.verdicts import worst_exit

    assert worst_exit([0, 0]) == 0
    assert worst_exit([0, 1]) == 1
    assert worst_exit([1, 2, 0]) == 2
    assert worst_exit([2, 3, 1, 0]) == 3
    assert worst_exit([]) == 0


def test_uncertain_workload_was_outranked_by_a_failed_one():
    """The failure: exit 4 (uncertain) was missing from the precedence, so a file with an uncertain
    and a starting workload exited 0, and an uncertain one beside a failed job exited 1."""
    from tuner.deploy.verdicts import worst_exit

    assert worst_exit([0, 4]) == 4
    assert worst_exit([4, 1, 2]) == 4
    assert worst_exit([4, 3]) == 3


# ------------------------------------------------------------------------------------------------
# The readers' rules (pure)
# ------------------------------------------------------------------------------------------------


def test_kubernetes_var_expansion_follows_the_kubelet():
    from tuner.deploy.commandline import k8s_env, k8s_expand

    env, notes = k8s_env([{"name": "A", "value": "x"}, {"name": "B", "value": "$(A)-y"},
                          {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}], "here")
    assert env == {"A": "x", "B": "x-y"} and "env S comes from valueFrom" in notes[0]
    assert k8s_expand("$(A) $$(A) $(NOPE)", env) == "x $(A) $(NOPE)"


def test_compose_interpolation_and_dotenv(tmp_path):
    from tuner.deploy import DeployFileError
    from tuner.deploy.compose import dotenv, interpolate

    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET} $SET ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$SET", env, where="f") == "v v d  d $SET"
    assert interpolate("${UNSET:-${SET}x}", env, where="f") == "vx"
    assert interpolate("${SET:+alt} ${EMPTY:+alt}", env, where="f") == "alt "
    with pytest.raises(DeployFileError, match="required variable UNSET is missing a value: say it"):
        interpolate("${UNSET:?say it}", env, where="f")
    e = _write(tmp_path, ".env", "export A=1\nB='two words'\nC=\"${A}-x\"\n# comment\n")
    assert dotenv(str(e)) == {"A": "1", "B": "two words", "C": "1-x"}


def test_compose_shell_environment_wins_over_dotenv():
    from tuner.deploy import read_deploy_file

    [w] = read_deploy_file(str(FIX / "compose" / "docker-compose.yaml"), environ={"GMU": "0.5"})
    assert w.argv[-2:] == ["--gpu-memory-utilization", "0.5"] and w.gpus == 1


def test_a_vllm_serve_shell_script_is_read_up_to_the_next_operator():
    from tuner.deploy.commandline import vllm_argv

    argv, notes = vllm_argv(["bash", "-c"], ["pip install x && exec vllm serve $M --max-model-len ${L:-4096}; echo done"],
                            image="python:3.12", env={"M": "org/m"})
    assert argv == ["vllm", "serve", "org/m", "--max-model-len", "4096"]
    assert vllm_argv(["nginx"], [], image="nginx", env={})[0] is None


def test_unknown_production_stack_key_is_listed_as_ignored():
    from tuner.deploy.helm import workloads

    [w] = workloads({"servingEngineSpec": {"modelSpec": [{"name": "m", "modelURL": L8B,
                                                           "vllmConfig": {"maxModelLen": 4096, "maxNumBatched": 8}}]}},
                    "values.yaml")
    assert w.argv == ["vllm", "serve", L8B, "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "4096"]
    assert [i["flag"] for i in w.ignored] == ["vllmConfig.maxNumBatched"]


def test_config_file_from_a_configmap_of_the_same_file(tmp_path):
    p = _write(tmp_path, "deploy.yaml", f"""apiVersion: v1
kind: ConfigMap
metadata: {{name: vllm-config}}
data:
  vllm.yaml: |
    model: {L8B}
    max-model-len: 131072
    gpu-memory-utilization: 0.25
---
apiVersion: batch/v1
kind: Job
metadata: {{name: once}}
spec:
  template:
    spec:
      containers:
        - name: vllm
          image: vllm/vllm-openai:v0.19.0
          command: [vllm, serve, --config, /etc/vllm/vllm.yaml]
""")
    rc, doc, _ = deploy(p)
    [w] = doc["workloads"]
    assert w["where"] == f"{p}:Job/once:containers[0].command"
    assert any("read from ConfigMap/vllm-config key vllm.yaml" in n for n in w["check"]["warnings"])
    same_as_line(w, LONG_LINE)


def test_a_workload_whose_job_fails_is_exit_1(monkeypatch):
    from tuner.errors import WorkerError

    def broken(request, **kw):
        raise WorkerError("worker died", where="test")

    monkeypatch.setattr("tuner.seam.worker.run_in_worker", broken)
    monkeypatch.chdir(FIX)
    rc, doc, _ = deploy("vllm-config.yaml")
    assert rc == 1 and doc["workloads"][0]["verdict"] == "failed" and "worker died" in doc["workloads"][0]["error"]


def test_ray_backend_spans_nodes_so_the_pod_gpu_count_does_not_refuse(tmp_path):
    p = _write(tmp_path, "pod.yaml", POD.format(
        args=f'"{L8B}", "-tp", "2", "--max-model-len", "8192", "--distributed-executor-backend", "ray"', env="",
        gpus=1))
    rc, doc, _ = deploy(p)
    assert rc == 0 and doc["workloads"][0]["verdict"] == "starts"


def test_vllm_additional_args_outside_kserve_is_listed_not_dropped(tmp_path):
    p = _write(tmp_path, "pod.yaml", POD.format(args=f'"{L8B}", "--max-model-len", "8192"',
                                                env="{name: VLLM_ADDITIONAL_ARGS, value: '--max-model-len 131072'}",
                                                gpus=1))
    rc, doc, _ = deploy(p)
    w = doc["workloads"][0]
    assert rc == 0 and w["check"]["max_model_len"] == 8192  # a plain Deployment: vLLM does not read it
    [e] = [e for e in w["check"]["read"]["ignored"] if e["flag"] == "env VLLM_ADDITIONAL_ARGS"]
    assert e["value"] == "--max-model-len 131072" and "vLLM itself does not read it" in e["note"]


def test_a_yaml_bomb_is_refused_as_invalid_input(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
    p = _write(tmp_path, "bomb.yaml", "\n".join(lines) + "\n")
    rc, doc, _ = deploy(p)
    assert rc == 2 and "possible YAML bomb" in doc["workloads"][0]["error"]


def test_every_kubernetes_kind_keeps_its_pod_template_where_the_api_says(tmp_path):
    from tuner.deploy import read_deploy_file

    c = "{containers: [{name: v, image: 'vllm/vllm-openai:v0.19.0', args: [m/x, --max-model-len, '1024']}]}"
    p = _write(tmp_path, "all.yaml", f"""apiVersion: v1
kind: List
items:
  - {{apiVersion: batch/v1, kind: CronJob, metadata: {{name: cj}}, spec: {{jobTemplate: {{spec: {{template: {{spec: {c}}}}}}}}}}}
  - {{apiVersion: apps/v1, kind: DaemonSet, metadata: {{name: ds}}, spec: {{template: {{spec: {c}}}}}}}
---
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata: {{name: lws}}
spec: {{leaderWorkerTemplate: {{leaderTemplate: {{spec: {c}}}, workerTemplate: {{spec: {{containers: [{{name: w, image: busybox}}]}}}}}}}}
---
apiVersion: llm-d.ai/v1alpha1
kind: ModelService
metadata: {{name: ms}}
spec:
  modelArtifacts: {{uri: "hf://m/y"}}
  decode:
    parallelism: {{tensor: 2}}
    containers: [{{name: vllm, modelCommand: vllmServe, args: [--max-model-len, "2048"]}}]
""")
    ws = read_deploy_file(str(p))
    assert [w.path for w in ws] == ["CronJob/cj:containers[0].args", "DaemonSet/ds:containers[0].args",
                                    "LeaderWorkerSet/lws:leaderTemplate:containers[0].args",
                                    "ModelService/ms:decode:containers[0].args"]
    assert ws[0].argv == ["vllm", "serve", "m/x", "--max-model-len", "1024"]
    assert ws[3].argv == ["vllm", "serve", "m/y", "--port", "8000", "--tensor-parallel-size", "2",
                          "--max-model-len", "2048"]


def _manifest(tmp_path, *, image: str, product: str, max_len: str) -> str:
    text = (FIX / "k8s-deployment.yaml").read_text()
    text = text.replace("vllm/vllm-openai:v0.19.0", image).replace("NVIDIA-H100-80GB-HBM3", product)
    text = text.replace('value: "131072"', f'value: "{max_len}"').replace('"0.25"', '"0.9"')
    p = tmp_path / "dep.yaml"
    p.write_text(text)
    return str(p)


def test_image_tag_release_was_ignored_and_the_verdict_flipped(tmp_path):
    """The failure (a new user's Deployment): `image: vllm/vllm-openai:v0.19.0` on an RTX 3090 at
    44400 tokens was checked as 0.34.0 (the newest modelled release, STARTS, exit 0) unless
    --engine-version was given. The image's tag names the release it runs."""
    path = _manifest(tmp_path, image="vllm/vllm-openai:v0.19.0", product="NVIDIA-GeForce-RTX-3090", max_len="44400")
    rc, out, err = _cli("check", "--json", "--no-variants", "--models-dir", MODELS, path)
    doc = json.loads(out)
    [w] = doc["workloads"]
    assert w["check"]["engine_version"] == "0.19.0" and w["check"]["release_assumed"] is None
    assert any("the release the image vllm/vllm-openai:v0.19.0 is tagged with" in n for n in w["check"]["warnings"])
    same = run_check(["vllm", "serve", str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
                      "--max-model-len", "44400", "--gpu-memory-utilization", "0.9"],
                     device="RTX-3090", engine_version="0.19.0", variants=False)
    assert rc == same.exit_code != 0
    # --engine-version wins over the tag
    rc, out, _ = _cli("check", "--json", "--no-variants", "--models-dir", MODELS, "--engine-version", "0.32.0", path)
    assert json.loads(out)["workloads"][0]["check"]["engine_version"] == "0.32.0"


def test_unknown_gpu_product_was_checked_on_another_card(tmp_path):
    """The failure: a manifest pinning a GPU product the catalog does not know was checked on
    whatever --device named (an H100 for an RTX 4000 Ada: STARTS, exit 0). Only a card stated with its
    memory (--device NAME:GIB) stands in for it; otherwise it is invalid input naming the product."""
    path = _manifest(tmp_path, image="vllm/vllm-openai:v0.19.0", product="NVIDIA-RTX-4000-Ada-Generation",
                     max_len="8192")
    rc, out, err = _cli("check", "--device", "H100-80GB", "--no-variants", "--models-dir", MODELS, path)
    assert rc == 2
    assert "NVIDIA-RTX-4000-Ada-Generation' names no catalog card" in out + err
    assert "--device H100-80GB names another card" in out + err
    rc, out, err = _cli("check", "--json", "--device", "RTX 4000 Ada:19.6", "--no-variants", "--models-dir", MODELS,
                        path)
    doc = json.loads(out)
    assert doc["workloads"][0]["check"]["device"]["total_memory_bytes"] == round(19.6 * 2**30)
    assert rc in (0, 3, 4)


def test_modelled_env_in_a_manifest_was_refused_as_not_modelled(tmp_path):
    """The failure: a container env the rules read (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, which
    decides whether vLLM 0.18+ takes the CUDA-graph estimate off the budget) was "not modelled" in a
    deploy file (exit 2) though a drop's `env` models it. It reaches the drop now: 0 leaves the
    0.84 GiB of Llama-3.1-8B's graphs in the cache (28714 blocks), 1 takes them off."""
    blocks = {}
    for value in ("0", "1"):
        p = tmp_path / f"pod{value}.yaml"
        p.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: llama}\nspec:\n"
                     "  nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}\n  containers:\n"
                     "    - name: vllm\n      image: vllm/vllm-openai:v0.32.0\n"
                     "      args: [meta-llama/Llama-3.1-8B-Instruct, --max-model-len, '32768']\n"
                     f"      env: [{{name: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, value: '{value}'}}]\n"
                     "      resources: {limits: {nvidia.com/gpu: '1'}}\n")
        rc, out, err = _cli("check", "--json", "--no-variants", "--models-dir", MODELS, str(p))
        assert rc == 0, err
        check = json.loads(out)["workloads"][0]["check"]
        assert not any("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS" in str(n) for n in check["not_modelled"])
        blocks[value] = (check["numbers"]["num_gpu_blocks"], check["numbers"]["cuda_graph_bytes"])
    assert blocks["0"][0] == 28749 and blocks["0"][1] == 0  # 28714 before §24's reserve refit
    assert blocks["1"][0] < 28749 and blocks["1"][1] > 0


def test_options_after_a_deploy_file_were_read_as_vllm_flags(monkeypatch):
    """The failure (a new user, following docs/deploy-files.md's synopsis `check FILE … [--device D]`):
    `check k8s-deployment.yaml --device H100-80GB` answered "unrecognized arguments: --device H100-80GB
    (vLLM refuses flags it does not know…)", exit 2; with --deploy-files the option and its value were
    read as file names. Options after the files are check's own."""
    monkeypatch.chdir(FIX)
    rc, out, err = _cli("check", "k8s-deployment.yaml", "--device", "H100-80GB", "--engine-version", "0.19.0",
                        "--no-variants", "--models-dir", MODELS)
    assert rc == 3 and out.rstrip().endswith("1 workload(s): 1 do not start; exit 3"), err
    rc, out, err = _cli("check", "--deploy-files", "k8s-deployment.yaml", "--device", "H100-80GB", "--engine-version",
                        "0.19.0", "--no-variants", "--models-dir", MODELS, "compose/docker-compose.yaml")
    assert rc == 3 and out.rstrip().endswith("2 workload(s): 2 do not start; exit 3"), err
