"""Fresh-user findings on ``check``'s serve line, its environment and its input messages (F1–F3, F7,
F13–F16): each test is named after what failed and asserts the real answer."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO
from tests._cli_helpers import run_cli as _cli
from tuner.memory.serve_args import merge_dotted, parse_serve
from tuner.reports.check import run_check

L8B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
MODELS = REPO.parent / "shared" / "models"
QWEN3_8B = MODELS / "Qwen--Qwen3-8B"
QWEN3_06B = MODELS / "Qwen--Qwen3-0.6B"


@pytest.fixture(autouse=True)
def _inproc(monkeypatch):
    from tests.test_check import inproc_worker

    monkeypatch.setattr("tuner.seam.worker.run_in_worker", inproc_worker)


def check(*argv, device="H100-80GB", version="0.26.0", **kw):
    return run_check(list(argv), device=device, engine_version=version, variants=False, **kw)


# -- F1: dotted JSON options are merged into one object, as vLLM's FlexibleArgumentParser does --------


def test_repeated_dotted_json_options_keep_every_key():
    sa = parse_serve(["vllm", "serve", "M", "--hf-overrides.max_position_embeddings=4096",
                      "--hf-overrides.rope_theta=1", "--hf_overrides.rope_scaling.rope_type", "yarn",
                      "--hf-overrides.rope_scaling.factor=4.0"])
    assert sa.values["hf_overrides"] == {"max_position_embeddings": 4096, "rope_theta": 1,
                                         "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert sa.notes == []


def test_dotted_option_given_twice_keeps_the_last_and_warns_as_vllm_does():
    args, _, notes = merge_dotted(["M", "--hf-overrides", '{"a": 1}', "--hf-overrides.b=2", "--hf-overrides.b=3",
                                   "--x.items+", "p,q"])
    # vLLM appends the merged object after the other arguments: it wins over the plain JSON value
    assert args == ["M", "--hf-overrides", '{"a": 1}', "--hf-overrides", '{"b": 3}', "--x", '{"items": ["p", "q"]}']
    assert notes == ["vLLM would warn: Found duplicate keys hf_overrides.b (the last one given wins)"]


def test_dotted_speculative_config_method_is_not_lost():
    res = check("vllm", "serve", str(L8B), "--max-model-len", "8192", "--speculative-config.method=ngram",
                "--speculative-config.num_speculative_tokens=4")
    assert res.doc["drop"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert res.exit_code == 0
    assert res.doc["command"].endswith("""--speculative-config '{"method":"ngram","num_speculative_tokens":4}'""")


def test_dotted_hf_overrides_echo_names_both_keys():
    res = check("vllm", "serve", str(L8B), "--hf-overrides.max_position_embeddings=4096",
                "--hf-overrides.rope_theta=1")
    assert res.doc["drop"]["hf_overrides"] == {"max_position_embeddings": 4096, "rope_theta": 1}
    assert res.doc["derived_max_model_len"] == 4096
    assert """--hf-overrides '{"max_position_embeddings":4096,"rope_theta":1}'""" in res.doc["command"]


# -- F2: a speculative config without method gets the method vLLM infers from its model ------------


def test_speculative_config_without_method_was_refused():
    from tuner.memory.specdecode import inferred_speculative_method as infer

    assert infer("ngram", draft_model_type=None, version=(0, 10, 1)) == "ngram"
    assert infer("yuhuili/EAGLE-LLaMA3-Instruct-8B", draft_model_type="llama", version=(0, 13, 0)) == "eagle"
    assert infer("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", draft_model_type="llama", version=(0, 26, 0)) == "eagle3"
    assert infer("x/heads", draft_model_type="medusa", version=(0, 26, 0)) == "medusa"
    assert infer("x/mtp", draft_model_type="deepseek_mtp", version=(0, 16, 0)) == "mtp"
    assert infer("Qwen/Qwen3-0.6B", draft_model_type="qwen3", version=(0, 17, 0)) == "draft_model"
    with pytest.raises(ValueError, match=r"^Unsupported speculative method: 'None'$"):
        infer("Qwen/Qwen3-0.6B", draft_model_type="qwen3", version=(0, 16, 0))
    with pytest.raises(ValueError, match="^Speculative decoding with draft model is not supported yet"):
        infer("Qwen/Qwen3-0.6B", draft_model_type="qwen3", version=(0, 14, 1))


@pytest.mark.skipif(not (QWEN3_06B / "config.json").is_file(), reason="shared models not here")
def test_speculative_config_model_only_is_a_draft_model_on_0_26():
    from tuner.question.vllm_args import ArgsInputError

    sc = json.dumps({"model": str(QWEN3_06B), "num_speculative_tokens": 4})
    res = check("vllm", "serve", str(QWEN3_8B), "--max-model-len", "8192", "--speculative-config", sc)
    assert res.doc["drop"]["speculative_config"] == {"model": str(QWEN3_06B), "num_speculative_tokens": 4,
                                                      "method": "draft_model"}
    assert any(w.startswith("speculative_config.method not given: draft_model, as vLLM 0.26.0 infers it from the "
                            f"model '{QWEN3_06B}' (its config.json's model_type 'qwen3'") for w in res.doc["warnings"])
    assert res.exit_code == 0
    with pytest.raises(ArgsInputError, match=r"Unsupported speculative method: 'None' \(vLLM 0.16.0's"):
        check("vllm", "serve", str(QWEN3_8B), "--max-model-len", "8192", "--speculative-config", sc,
              version="0.16.0")


# -- F3: CUDA_VISIBLE_DEVICES bounds the world size, on a line and in a container -----------------

WORLD_2_OF_1 = "World size (2) is larger than the number of available GPUs (1) in this node."


def test_cuda_visible_devices_prefix_was_ignored():
    line = ["vllm", "serve", str(L8B), "--max-model-len", "8192", "--tensor-parallel-size", "2"]
    assert check(*line, device="RTX-4090").exit_code == 0
    res = check("CUDA_VISIBLE_DEVICES=0", *line, device="RTX-4090")
    assert res.exit_code == 3 and res.doc["verdict"] == "does not start"
    assert res.doc["engine_error"].startswith(WORLD_2_OF_1)
    ok = check("CUDA_VISIBLE_DEVICES=0,1", *line, device="RTX-4090")
    assert ok.exit_code == 0
    assert "CUDA_VISIBLE_DEVICES=0,1: 2 GPU(s) visible to vLLM; the world size (tensor × pipeline parallel) is 2" \
        in ok.doc["warnings"]


def test_visible_gpu_count_reads_cuda_visible_devices_as_cuda_does():
    from tuner.memory.engine_checks import visible_gpu_count, world_size_refusal

    assert [visible_gpu_count(v) for v in ("0", "0,1", "", "-1", "0,-1,2", "GPU-1a2b,GPU-3c4d")] == [1, 2, 0, 0, 1, 2]
    assert world_size_refusal(2, 1, version=(0, 13, 0)).startswith(WORLD_2_OF_1)
    assert "picks the Ray backend" in world_size_refusal(2, 1, version=(0, 11, 0))
    assert world_size_refusal(2, 2, version=(0, 26, 0)) is None


def test_container_cuda_visible_devices_was_ignored():
    from tuner.deploy import Workload
    from tuner.deploy.verdicts import check_workload

    w = Workload(file="compose.yaml", path="services.vllm", kind="compose service", gpus=2,
                 env={"CUDA_VISIBLE_DEVICES": "0"},
                 argv=["vllm", "serve", str(L8B), "--max-model-len", "8192", "-tp", "2"])
    v = check_workload(w, device="RTX-4090", engine_version="0.26.0", variants=False)
    assert v.exit_code == 3
    assert v.doc["engine_error"].startswith(WORLD_2_OF_1)
    assert any(x.startswith("the container's CUDA_VISIBLE_DEVICES=0 shows 1 GPU(s); vLLM refuses")
               for x in v.doc["warnings"])


# -- F7, F16: a missing deploy file, a drop given to check ----------------------------------------


def test_missing_deploy_file_was_blamed_on_the_model(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    rc, out, err = _cli("check", "--device", "L4", missing)
    assert rc == 2
    assert err.strip() == f"ctx-tuner check: invalid input: no such deploy file: {missing}"
    rc, out, err = _cli("check", missing, "--device", "L4")  # check's options after the files
    assert rc == 2 and err.strip() == f"ctx-tuner check: invalid input: no such deploy file: {missing}"


def test_drop_given_to_check_did_not_point_to_profile():
    drop = "configs/examples/llama-3.1-8b-rtx3090-v0.yaml"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        rc, out, err = _cli("check", drop)
    finally:
        os.chdir(cwd)
    assert rc == 2
    assert (f"{drop}: a ctx-tuner drop file (model, device, candidates: docs/drops.md), not a deploy file: profile "
            f"it with `ctx-tuner profile {drop}`, or explain one point with `ctx-tuner explain {drop}`") in out


# -- F13: a VLLM_* name no release reads ----------------------------------------------------------


def test_unknown_vllm_env_name_was_called_a_vllm_variable():
    from tuner.question.vllm_args import env_not_modelled

    nm, ignored = env_not_modelled({"VLLM_FOO_BAR": "1", "VLLM_USE_V2_MODEL_RUNER": "1",
                                    "VLLM_ATTENTION_BACKEND": "FLASHINFER"}, source="command line")
    assert [n.argument for n in nm] == ["env VLLM_ATTENTION_BACKEND"]
    notes = {e["flag"]: e["note"] for e in ignored}
    assert notes["env VLLM_FOO_BAR"].startswith("not a vLLM environment variable: no release's vllm/envs.py "
                                                "(0.4.2–0.34.0) defines it, so vLLM ignores it")
    assert notes["env VLLM_USE_V2_MODEL_RUNER"].endswith("; did you mean VLLM_USE_V2_MODEL_RUNNER?")
    res = check("VLLM_FOO_BAR=1", "vllm", "serve", str(L8B), "--max-model-len", "8192")
    assert res.exit_code == 0 and res.doc["not_modelled"] == []


# -- F14: a FIFO config.json names its path --------------------------------------------------------


def test_fifo_config_message_omitted_the_path(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    os.mkfifo(model / "config.json")
    rc, out, err = _cli("check", "--device", "L4", "--engine-version", "0.26.0", "--", "vllm", "serve", str(model))
    assert rc == 2
    assert (f"vllm serve:model: {model / 'config.json'}: not a regular file (a FIFO); a model config must be a "
            "regular file") in err


# -- F15: a pre-release is answered with the release's rules, said so ------------------------------


def test_release_candidate_was_answered_as_the_release_silently():
    from tuner.reports.check import pre_release_note

    assert pre_release_note("0.26.0rc1") == ("vLLM 0.26.0rc1 is not a release: answered with vLLM 0.26.0's rules "
                                             "(the release it leads to); a pre-release or development build may "
                                             "differ from it")
    assert pre_release_note("0.11.1.dev5+g1234") is not None
    assert [pre_release_note(v) for v in ("0.26.0", "0.10.1.1", "0.6.4.post1", None)] == [None] * 4
    res = check("vllm", "serve", str(L8B), "--max-model-len", "8192", version="0.26.0rc1")
    assert pre_release_note("0.26.0rc1") in res.doc["warnings"]
