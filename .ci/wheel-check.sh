#!/usr/bin/env bash
# ctx-tuner installed as users install it (issue 30): `python -m build` makes the wheel, a fresh venv
# gets CPU torch and that wheel (no checkout on sys.path), and `ctx-tuner check` runs from it outside
# the checkout: a deploy file with two vLLM workloads (exit 3: one does not start) and a serve line
# (exit 0). Prints the step's time. Usage: .ci/wheel-check.sh [PYTHON_WITH_BUILD] (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
py="${1:-.venv/bin/python}"
t0=$SECONDS
work="$(mktemp -d /tmp/ctx-tuner-wheel.XXXXXX)"
trap 'rm -rf "$work"' EXIT
"$py" -m build --wheel --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { tail -20 "$work/build.log"; echo "wheel tier: FAILED: python -m build" >&2; exit 1; }
wheel="$(ls "$work"/dist/ctx_tuner-*.whl)"
build_s=$((SECONDS - t0))
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q torch==2.13.0 "$wheel"
install_s=$((SECONDS - t0 - build_s))
cd "$work"
where="$("$work/venv/bin/python" -c 'import tuner; print(tuner.__file__)')"
case "$where" in
    "$work/venv/"*) ;;
    *) echo "wheel tier: FAILED: tuner imported from $where, not the installed wheel" >&2; exit 1 ;;
esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t1=$SECONDS
rc=0
"$work/venv/bin/ctx-tuner" check --device H100-80GB --engine-version 0.19.0 --no-variants \
    --models-dir "$repo/configs/models" "$repo/tests/fixtures/deploy/helm-template-two-workloads.yaml" \
    >"$work/check.out" 2>&1 || rc=$?
tail -1 "$work/check.out"
if [ "$rc" -ne 3 ]; then cat "$work/check.out"; echo "wheel tier: FAILED: deploy-file check exit $rc, expected 3" >&2; exit 1; fi
rc=0
"$work/venv/bin/ctx-tuner" check --device H100-80GB --engine-version 0.19.0 --no-variants -- \
    vllm serve "$repo/configs/models/meta-llama--Llama-3.1-8B-Instruct" --max-model-len 8192 >"$work/check2.out" 2>&1 || rc=$?
if [ "$rc" -ne 0 ]; then cat "$work/check2.out"; echo "wheel tier: FAILED: serve-line check exit $rc, expected 0" >&2; exit 1; fi
echo "wheel tier: $(basename "$wheel") built in ${build_s} s, installed (torch==2.13.0 + wheel, fresh venv) in ${install_s} s, two checks in $((SECONDS - t1)) s; total $((SECONDS - t0)) s"
