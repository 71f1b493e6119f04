"""Refusals vLLM raises after the KV size check (issue 33): a point whose KV cache fits can still fail
to start. Each rule is read from the release's source and tested at both sides of its first release."""

from __future__ import annotations

import dataclasses

import pytest

from tuner.memory import kvcache
from tuner.memory.eras import era_for
from tuner.memory.search import MAMBA_MAX_NUM_SEQS_CHECK_FROM, mamba_max_num_seqs_refusal


@dataclasses.dataclass
class _Layout:
    kv_specs: list


def _mamba_layout() -> _Layout:
    attn = kvcache.FullAttentionSpec(block_size=784, num_kv_heads=4, head_size=256, dtype_bytes=2)
    state = kvcache.MambaSpec(block_size=784, shapes=((3, 8192), (32, 128, 128)), dtypes_bytes=(2, 2))
    return _Layout(kv_specs=[{"model.layers.0.self_attn": attn, "model.layers.1.linear_attn": state}])


def test_mamba_check_first_release_is_read_from_source():
    # vllm/config/compilation.py resolve_cudagraph_mode_and_sizes raises from 0.20.0; 0.19.0's
    # adjust_cudagraph_sizes_for_mamba_cache only capped the capture sizes.
    assert MAMBA_MAX_NUM_SEQS_CHECK_FROM == (0, 20, 0)


@pytest.mark.parametrize("version, refused", [("0.19.0", False), ("0.20.0", True), ("0.32.0", True)])
def test_max_num_seqs_above_mamba_blocks_refused_from_0_20(version, refused):
    msg = mamba_max_num_seqs_refusal(era_for(version), _mamba_layout(), max_num_seqs=1024, num_blocks=969)
    if refused:
        assert msg == ("max_num_seqs (1024) exceeds available Mamba cache blocks (969). Each decode sequence "
                       "requires one Mamba cache block, so CUDA graph capture cannot proceed. Please lower "
                       "max_num_seqs to at most 969 or increase gpu_memory_utilization.")
    else:
        assert msg is None


def test_mamba_check_needs_full_cuda_graphs_and_mamba_layers():
    layout = _mamba_layout()
    # enforce_eager: no CUDA graphs, no check (cudagraph_mode NONE has no full graphs)
    assert mamba_max_num_seqs_refusal(era_for("0.32.0", enforce_eager=True), layout, max_num_seqs=1024,
                                      num_blocks=969) is None
    # exactly as many blocks as sequences starts (the check is max_num_seqs > num_blocks)
    assert mamba_max_num_seqs_refusal(era_for("0.32.0"), layout, max_num_seqs=969, num_blocks=969) is None
    dense = _Layout(kv_specs=[{"model.layers.0.self_attn": layout.kv_specs[0]["model.layers.0.self_attn"]}])
    assert mamba_max_num_seqs_refusal(era_for("0.32.0"), dense, max_num_seqs=1024, num_blocks=969) is None


def test_hybrid_drop_with_1024_seqs_starting_with_fewer_mamba_blocks(shared_dir):
    """The failure: a 1,024-sequence hybrid drop was reported as starting with fewer Mamba state blocks
    than sequences, where vLLM 0.20+ refuses at CUDA-graph set-up. Qwen3.6-27B-FP8 on an H100 at
    gmu 0.9, 4096 tokens: 792 blocks on 0.20.0 (refused), 816 on 0.19.0 (starts; 0.19 caps the
    capture sizes)."""
    from tuner.reports.check import run_check

    model = str(shared_dir / "models" / "Qwen--Qwen3.6-27B-FP8")
    line = ["vllm", "serve", model, "--max-model-len", "4096", "--max-num-seqs", "1024",
            "--gpu-memory-utilization", "0.9"]
    new = run_check(line, device="H100-80GB", engine_version="0.20.0", variants=False)
    assert new.exit_code == 3
    # 793 / 817 since §24's reserve refit (792 / 816 before)
    assert new.doc["numbers"]["num_gpu_blocks"] == 793
    assert "max_num_seqs (1024) exceeds available Mamba cache blocks (793)" in new.doc["engine_error"]
    old = run_check(line, device="H100-80GB", engine_version="0.19.0", variants=False)
    assert old.exit_code == 0
    assert old.doc["numbers"]["num_gpu_blocks"] == 817
    fewer = run_check(line[:-4] + ["--max-num-seqs", "512", "--gpu-memory-utilization", "0.9"],
                      device="H100-80GB", engine_version="0.20.0", variants=False)
    assert fewer.exit_code == 0


def test_check_could_not_be_told_of_memory_held_by_other_processes():
    """The failure: co-tenant memory could be stated in a drop (other_processes_memory_gib) but not to
    ``check``, which then said STARTS for a line vLLM refuses in its free-memory check (0.9.1+)."""
    from tests._cli_helpers import run_cli
    from tests.conftest import REPO

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    base = ["check", "--device", "H100-80GB", "--engine-version", "0.32.0", "--no-variants"]
    line = ["--", "vllm", "serve", model, "--max-model-len", "32k", "--gpu-memory-utilization", "0.92"]
    rc, out, _ = run_cli(*base, *line)
    assert rc == 0 and "STARTS" in out
    rc, out, _ = run_cli(*base, "--other-processes-memory-gib", "10", *line)
    assert rc == 3
    assert "Free memory on device cuda:0 (69.19/79.19 GiB) on startup is less than desired GPU memory " \
           "utilization (0.92, 72.86 GiB)" in out
    rc, out, _ = run_cli(*base, "--other-processes-memory-gib", "10", *line[:-1], "0.85")
    assert rc == 0 and "25481 blocks" in out  # 25446 before §24


@pytest.mark.parametrize("version, u, starts", [("0.19.0", 0.98, True), ("0.19.0", 0.99, False),
                                                ("0.20.0", 0.99, True)])
def test_graph_capture_after_the_cache_out_of_memory_reported_as_starting(version, u, starts):
    """The failure: a start-up whose CUDA-graph capture runs out of memory after the KV cache was
    allocated was reported as starting. On 0.19 the capture (0.84 GiB for Llama-3.1-8B, 512 seqs)
    is not taken off the budget, so at gmu 0.99 on an H100 the cache fills 78.40 GiB and the capture
    needs 85,081,718,784 bytes of the card's 85,030,076,416; 0.20 subtracts the estimate and starts."""
    from tests.conftest import REPO
    from tuner.reports.check import run_check

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    res = run_check(["vllm", "serve", model, "--max-model-len", "32768", "--gpu-memory-utilization", str(u)],
                    device="H100-80GB", engine_version=version, variants=False)
    assert res.starts is starts
    if not starts:
        assert res.doc["engine_error"].startswith(
            "CUDA out of memory during CUDA graph capture: the KV cache fills the requested 84,179,775,652 bytes")
        assert "need 85,081,718,784 bytes, more than the GPU's 85,030,076,416 bytes" in res.doc["engine_error"]


def test_graph_capture_oom_not_charged_with_enforce_eager():
    from tests.conftest import REPO
    from tuner.reports.check import run_check

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    res = run_check(["vllm", "serve", model, "--max-model-len", "32768", "--gpu-memory-utilization", "0.99",
                     "--enforce-eager"], device="H100-80GB", engine_version="0.19.0", variants=False)
    assert res.starts is True


def _drop(tmp_path, **extra) -> str:
    import yaml

    from tests.conftest import REPO

    d = {"name": "runner", "model": str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
         "device": "H100-80GB", "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [32768]}, **extra}
    p = tmp_path / "runner.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


def _blocks(path: str) -> tuple[int, list]:
    import json

    from tests._cli_helpers import run_cli

    rc, out, err = run_cli("profile", path, "--json", "--db", "sqlite:///" + str(path) + ".sqlite")
    assert rc == 0, err
    doc = json.loads(out)
    return doc["candidates"][0]["num_gpu_blocks"], doc.get("warnings") or []


def test_model_runner_could_not_be_chosen_as_vllm_users_do(tmp_path):
    """The failure: which model runner runs was fixed by the release's default; an operator setting
    VLLM_USE_V2_MODEL_RUNNER could not say so. 0.26 runs Llama-3.1-8B on Model Runner V2 by
    default (listed architecture, not MoE); false runs the V1 runner, whose budget differs."""
    default, _ = _blocks(_drop(tmp_path, engine_version="0.26.0"))
    forced_v1, warnings = _blocks(_drop(tmp_path, engine_version="0.26.0", use_v2_model_runner=False))
    same, _ = _blocks(_drop(tmp_path, engine_version="0.26.0", use_v2_model_runner=True))
    assert same == default
    assert forced_v1 != default
    assert any("use_v2_model_runner false: vLLM 0.26.0 runs the V1 model runner" in w for w in warnings)


def test_model_runner_v2_before_it_is_modelled_is_refused(tmp_path):
    from tests._cli_helpers import run_cli

    rc, _, err = run_cli("profile", _drop(tmp_path, engine_version="0.19.0", use_v2_model_runner=True), "--json",
                         "--db", "sqlite:///" + str(tmp_path / "x.sqlite"))
    assert rc == 2
    assert "use_v2_model_runner" in err and "not modelled" in err


def test_draft_model_with_another_vocabulary_reported_as_starting():
    """The failure: a draft_model drafter whose vocabulary differs from the target's (Llama-3.1-8B
    128256, Qwen3-0.6B 151936) was 'STARTS: 14770 blocks' on 0.32; vLLM's SpeculativeConfig refuses it
    before loading anything, from 0.15.0 (verify_equal_vocab_size_if_draft_model; absent in 0.14.0)."""
    from tests.conftest import REPO
    from tuner.reports.check import run_check
    from tuner.errors import TunerError

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    draft = str(REPO.parent / "shared" / "models" / "Qwen--Qwen3-0.6B")
    line = ["vllm", "serve", model, "--max-model-len", "8192", "--speculative-config",
            '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}' % draft]
    with pytest.raises(TunerError) as exc:  # invalid input (exit 2), as the other refusals of the configuration
        run_check(line, device="H100-80GB", engine_version="0.32.0", variants=False)
    assert ("Target and draft model should have the same vocabulary size. Target model vocab_size=128256. Draft "
            "model vocab_size=151936.") in str(exc.value)
    assert run_check(line, device="H100-80GB", engine_version="0.14.0", variants=False).starts is True


def test_draft_vocab_rule_by_release_and_method():
    from tuner.memory.engine_checks import DRAFT_VOCAB_CHECK_FROM, check_draft_vocab
    from tuner.errors import DropError

    assert DRAFT_VOCAB_CHECK_FROM == (0, 15, 0)
    sc = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
    with pytest.raises(DropError):
        check_draft_vocab(sc, draft_config={"vocab_size": 10}, target_config={"text_config": {"vocab_size": 11}},
                          version="0.15.0", path=None)
    check_draft_vocab(sc, draft_config={"vocab_size": 10}, target_config={"vocab_size": 11}, version="0.14.0",
                      path=None)
    check_draft_vocab({**sc, "method": "eagle3"}, draft_config={"vocab_size": 10}, target_config={"vocab_size": 11},
                      version="0.34.0", path=None)  # eagle heads map their own vocab (draft_has_own_vocab false)
    check_draft_vocab(sc, draft_config={"vocab_size": 11}, target_config={"vocab_size": 11}, version="0.34.0",
                      path=None)


def test_max_model_len_auto_ignored_the_cap_vllm_honours():
    """vLLM's auto-fit (0.14+) starts from the derived length, so a lowered max_position_embeddings
    (--hf-overrides) caps it: Llama-3.1-8B on an RTX 3090 at 0.32 fits 43392 uncapped, 32768 capped."""
    from tests.conftest import REPO
    from tuner.reports.check import run_check

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    free = run_check(["vllm", "serve", model, "--max-model-len", "auto"], device="RTX 3090", engine_version="0.32.0",
                     variants=False)
    capped = run_check(["vllm", "serve", model, "--max-model-len", "auto", "--hf-overrides",
                        '{"max_position_embeddings": 32768}'], device="RTX 3090", engine_version="0.32.0",
                       variants=False)
    assert free.doc["max_model_len"] == 43968 and capped.doc["max_model_len"] == 32768  # 43392 before §24
    assert any("Auto-fit max_model_len: full model context length 32768 fits" in w for w in capped.doc["warnings"])


def test_cold_compile_cache_could_not_be_stated():
    """The failure: a cold first boot (torch.compile cache empty: Inductor compiles in the profile run,
    max-autotune for single-size ranges) could not be told to check or a drop. Now `compile_cache: cold`
    is named as a not-modelled input and widens the interval; warm / unstated are answered as modelled;
    with enforce_eager nothing is compiled and nothing widens."""
    from tests.conftest import REPO
    from tuner.reports.check import run_check

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    line = ["vllm", "serve", model, "--max-model-len", "32768"]
    plain = run_check(line, device="H100-80GB", engine_version="0.32.0", variants=False)
    warm = run_check(line, device="H100-80GB", engine_version="0.32.0", variants=False, compile_cache="warm")
    cold = run_check(line, device="H100-80GB", engine_version="0.32.0", variants=False, compile_cache="cold")
    assert plain.doc["interval"] == warm.doc["interval"]
    assert plain.doc["numbers"]["num_gpu_blocks"] == cold.doc["numbers"]["num_gpu_blocks"] == 28319  # 28284 before §24
    lo = lambda r: r.doc["interval"]["num_gpu_blocks_low"]  # noqa: E731
    assert (lo(plain), lo(cold)) == (27892, 26773)  # the round-3 refit bands (27821, 26702 before §24)
    assert any(w.startswith("assumed compile_cache: cold (a cold torch.compile cache") for w in cold.doc["warnings"])
    assert not any("compile_cache" in w for w in warm.doc["warnings"])
    eager = run_check(line + ["--enforce-eager"], device="H100-80GB", engine_version="0.32.0", variants=False,
                      compile_cache="cold")
    assert not any("compile_cache" in w for w in eager.doc["warnings"])


def test_cold_compile_cache_widened_the_high_end_too():
    """F9: `--compile-cache cold` widened the interval upward as well (52.75 to 60.43 GiB around a warm
    56.59), though a cold cache can only make the KV cache smaller: its band lowers the safe end only
    (the high end is the warm one's)."""
    from tests.conftest import REPO
    from tuner.reports.check import run_check

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    line = ["vllm", "serve", model, "--max-model-len", "32768"]
    warm = run_check(line, device="H100-80GB", engine_version="0.32.0", variants=False, compile_cache="warm")
    cold = run_check(line, device="H100-80GB", engine_version="0.32.0", variants=False, compile_cache="cold")
    w, c = warm.doc["interval"], cold.doc["interval"]
    assert c["num_gpu_blocks_high"] == w["num_gpu_blocks_high"]
    assert c["available_kv_cache_bytes_high"] == w["available_kv_cache_bytes_high"]
    assert c["num_gpu_blocks_low"] == 26773 < w["num_gpu_blocks_low"] == 27892  # 26702 / 27821 before §24
    band = next(b for b in c["bands"] if b["name"] == "not modelled: compile_cache")
    assert band["low_bytes"] == 0 < band["high_bytes"]
    from tuner.memory.uncertainty import band_text

    assert band_text(band).endswith("GiB (lowers the KV only)") and band_text(band).startswith("-")


def test_compile_cache_drop_field_is_checked(tmp_path):
    from tuner.question.drop import parse_drop
    from tuner.errors import DropError

    base = "name: x\nmodel: m\ndevice: H100-80GB\ncandidates: {gpu_memory_utilization: [0.9]}\n"
    assert parse_drop(base + "compile_cache: COLD\n", "/d/x.yaml").compile_cache == "cold"
    assert parse_drop(base, "/d/x.yaml").compile_cache is None
    with pytest.raises(DropError) as exc:
        parse_drop(base + "compile_cache: lukewarm\n", "/d/x.yaml")
    assert "compile_cache" in str(exc.value) and "cold, warm" in str(exc.value)


def test_model_runner_release_default_was_silent(capsys):
    """F6: with no VLLM_USE_V2_MODEL_RUNNER, 0.26 on an H100 printed `CUDA graphs 0.00 GiB` with no word of
    which runner was assumed (a note appeared only with the variable set). The runner the release's
    default picked is an assumption line (output and JSON ``assumptions``); none where the line chose."""
    import json

    from tuner.cli import main

    from tests.conftest import REPO

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    base = ["check", "--device", "H100-80GB", "--engine-version", "0.26.0", "--no-variants"]
    serve = ["vllm", "serve", model, "--max-model-len", "32768"]
    assert main(base + ["--"] + serve) == 0
    out = capsys.readouterr().out
    assert ("note: assumed model runner: Model Runner V2 (vLLM 0.26.0's default for LlamaForCausalLM, "
            "vllm/config/vllm.py use_v2_model_runner as tuner/memory/eras.py uses_model_runner_v2 reads it; "
            "VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner)") in out
    assert main(base + ["--json", "--"] + serve) == 0
    said = [a for a in json.loads(capsys.readouterr().out)["assumptions"] if a["name"] == "model runner"]
    assert said and said[0]["value"] == "Model Runner V2" and said[0]["effect"] == "modelled"
    assert main(base + ["--", "VLLM_USE_V2_MODEL_RUNNER=1"] + serve) == 0
    assert "assumed model runner" not in capsys.readouterr().out
    assert main(["check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants", "--"] + serve) == 0
    assert "assumed model runner" not in capsys.readouterr().out  # one runner before 0.22


def test_model_runner_env_on_the_serve_line_was_not_read(capsys):
    """The failure: `VLLM_USE_V2_MODEL_RUNNER=0 vllm serve …` (as operators write it) was 'unrecognized
    arguments: vllm', exit 2; the variable is now read from the line as from a drop's env or a deploy
    file's container env. 0.26 runs Llama-3.1-8B on Model Runner V2 by default (28974 blocks at 32768);
    =0 runs the V1 runner (28060)."""
    from tuner.cli import main

    from tests.conftest import REPO

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    base = ["check", "--device", "H100-80GB", "--engine-version", "0.26.0", "--no-variants", "--"]
    serve = ["vllm", "serve", model, "--max-model-len", "32768"]
    assert main(base + ["VLLM_USE_V2_MODEL_RUNNER=0", "VLLM_LOGGING_LEVEL=DEBUG"] + serve) == 0
    out = capsys.readouterr().out
    assert "STARTS: max_model_len 32768 at gpu_memory_utilization 0.92: 28096 blocks" in out  # 28060 before §24
    assert "note: use_v2_model_runner false: vLLM 0.26.0 runs the V1 model runner" in out
    assert "ignored: VLLM_LOGGING_LEVEL=DEBUG (no effect on start-up memory)" in out
    assert main(base + ["env", "VLLM_USE_V2_MODEL_RUNNER=1"] + serve) == 0
    assert "29009 blocks" in capsys.readouterr().out
    assert main(base + serve) == 0
    assert "29009 blocks" in capsys.readouterr().out
    # a vLLM variable no rule reads: not modelled; a VLLM_* name no release defines: ignored, as vLLM ignores it
    assert main(base + ["VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE=1"] + serve) == 2
    assert "does not model VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE=1" in capsys.readouterr().err
    assert main(base + ["VLLM_SOMETHING_NEW=1"] + serve) == 0
    assert "ignored: VLLM_SOMETHING_NEW=1 (not a vLLM environment variable" in capsys.readouterr().out


def test_disable_chunked_mm_input_called_a_flag_vllm_does_not_know():
    """The failure: --disable-chunked-mm-input (vLLM 0.8.4+) was 'unrecognized arguments … vLLM refuses
    flags it does not know'; it is vLLM's, and makes vLLM refuse a model whose largest multimodal item
    exceeds max_num_batched_tokens. Now modelled (drop field disable_chunked_mm_input), the refusal
    checked (tests below)."""
    from tuner.memory.serve_args import MODELLED, flag_for

    f = flag_for("disable_chunked_mm_input")
    assert f is not None and f.role == MODELLED and f.options == ("--disable-chunked-mm-input",)
    assert f.drop_field == "disable_chunked_mm_input" and "compute_mm_encoder_budget" in f.note


_MM_REFUSAL = ("Chunked MM input disabled but max_tokens_per_mm_item ({t}) is larger than max_num_batched_tokens "
               "({n}). Please increase max_num_batched_tokens.")


def _check(model: str, version: str, *extra: str):
    from tests.conftest import REPO
    from tuner.reports.check import run_check

    line = ["vllm", "serve", str(REPO.parent / "shared" / "models" / model), "--max-model-len", "8192", *extra]
    return run_check(line, device="H100-80GB", engine_version=version, variants=False)


@pytest.mark.parametrize("version", ["0.19.0", "0.34.0"])
def test_multimodal_item_larger_than_batch_reported_as_starting(version):
    """The failure: Qwen3.5-27B with --disable-chunked-mm-input at the default 8192-token batch was
    'not modelled' (exit 2 without a verdict; with --allow-unmodelled 'STARTS'); vLLM's
    compute_mm_encoder_budget (v1/core/encoder_cache_manager.py, the same check and message 0.8.4 →
    0.34.0) refuses it: the largest dummy image (16.8 MP) is 16384 tokens. 16384 batched tokens start."""
    from tuner.errors import TunerError

    with pytest.raises(TunerError) as exc:
        _check("Qwen--Qwen3.5-27B", version, "--disable-chunked-mm-input")
    assert _MM_REFUSAL.format(t=16384, n=8192) in str(exc.value)
    assert "(--disable-chunked-mm-input; vLLM's compute_mm_encoder_budget" in str(exc.value)
    # 16384 batched tokens fit the item: the same (memory) verdict as the chunked line at that batch, and
    # chunked at the default batch the item is split across steps: no refusal either (on this 80 GB card
    # 0.34.0's memory verdict for the 27B at 8192 is 'does not start' with or without the flag)
    expected = {"0.19.0": "starts", "0.34.0": "does not start"}[version]
    whole = _check("Qwen--Qwen3.5-27B", version, "--disable-chunked-mm-input", "--max-num-batched-tokens", "16384")
    chunked = _check("Qwen--Qwen3.5-27B", version, "--max-num-batched-tokens", "16384")
    assert whole.doc["verdict"] == chunked.doc["verdict"] == expected
    assert _check("Qwen--Qwen3.5-27B", version).doc["verdict"] == expected


def test_disable_chunked_mm_input_refused_from_0_8_4():
    """Gemma 3 (256-token image) with the flag and a 200-token batch: refused on 0.10.1.1 (the check
    reads the same there); 0.8.3 has neither the flag nor the check, so the line is vLLM's
    'unrecognized arguments' there, as for any flag the release lacks."""
    from tuner.errors import TunerError

    with pytest.raises(TunerError) as exc:
        _check("google--gemma-3-4b-it", "0.10.1.1", "--disable-chunked-mm-input", "--max-num-batched-tokens", "200")
    assert _MM_REFUSAL.format(t=256, n=200) in str(exc.value)
    with pytest.raises(TunerError, match=r"unrecognized arguments: --disable-chunked-mm-input \(vLLM 0.8.4\+\)"):
        _check("google--gemma-3-4b-it", "0.8.3", "--disable-chunked-mm-input", "--max-num-batched-tokens", "200")


def test_gemma3_small_batch_reported_as_starting_where_vllm_forces_unchunked_mm_input():
    """The failure: Gemma 3 with --max-num-batched-tokens 128 'STARTS' on every release; from 0.13
    vllm/platforms/cuda.py forces disable_chunked_mm_input for models with multimodal-bidirectional
    attention (MM_PREFIX_LM_MODELS: gemma3), so the 256-token image no longer fits one batch and
    vLLM refuses. 0.12.0 (no forcing) starts; 0.13.0 and 0.34.0 refuse; 256 tokens fit; with images
    limited to 0 the budget counts no modality (vLLM: 'Encoder cache will not be initialized')."""
    from tuner.errors import TunerError

    assert _check("google--gemma-3-4b-it", "0.12.0", "--max-num-batched-tokens", "128").starts is True
    for version in ("0.13.0", "0.34.0"):
        with pytest.raises(TunerError) as exc:
            _check("google--gemma-3-4b-it", version, "--max-num-batched-tokens", "128")
        assert _MM_REFUSAL.format(t=256, n=128) in str(exc.value)
        assert f"forced by vLLM {version} on CUDA for model_type 'gemma3'" in str(exc.value)
    assert _check("google--gemma-3-4b-it", "0.13.0", "--max-num-batched-tokens", "256").starts is True
    assert _check("google--gemma-3-4b-it", "0.34.0", "--max-num-batched-tokens", "128", "--limit-mm-per-prompt",
                  '{"image": 0}').starts is True


def test_chunked_mm_input_rule_by_release():
    """The rule and vLLM's MM_PREFIX_LM_MODELS at both sides of each change (read from the source)."""
    from tuner.errors import DropError
    from tuner.memory.engine_checks import (CHUNKED_MM_INPUT_CHECK_FROM, check_chunked_mm_input,
                                            mm_prefix_lm_forces_unchunked as forced)

    assert CHUNKED_MM_INPUT_CHECK_FROM == (0, 8, 4)
    kw = dict(max_tokens_per_item=577, max_num_batched_tokens=576, model_type="llava_next", engine="V1",
              user_max_num_batched_tokens=576, path="d.yaml")
    check_chunked_mm_input(disable_chunked_mm_input=True, version="0.8.3", **kw)
    with pytest.raises(DropError) as exc:
        check_chunked_mm_input(disable_chunked_mm_input=True, version="0.8.4", **kw)
    assert exc.value.field == "max_num_batched_tokens"
    check_chunked_mm_input(disable_chunked_mm_input=False, version="0.34.0", **kw)  # chunked: no refusal
    check_chunked_mm_input(disable_chunked_mm_input=True, version="0.34.0", **{**kw, "max_tokens_per_item": 576})
    check_chunked_mm_input(disable_chunked_mm_input=True, version="0.10.1.1", **{**kw, "engine": "V0"})
    check_chunked_mm_input(disable_chunked_mm_input=True, version="0.34.0", **{**kw, "max_tokens_per_item": 0})
    assert [forced("gemma3", v) for v in ("0.12.0", "0.13.0", "0.34.0")] == [False, True, True]
    assert [forced("paligemma", v) for v in ("0.13.0", "0.14.0")] == [False, True]
    assert [forced("molmo2", v) for v in ("0.14.1", "0.15.0")] == [False, True]
    assert [forced("bagel", v) for v in ("0.17.1", "0.18.0")] == [False, True]
    assert [forced("umm", v) for v in ("0.19.1", "0.20.1", "0.28.0", "0.29.0")] == [False, True, True, False]
    assert [forced("moondream3", v) for v in ("0.20.2", "0.21.0")] == [False, True]
    assert not forced("qwen3_5", "0.34.0") and not forced(None, "0.34.0")
