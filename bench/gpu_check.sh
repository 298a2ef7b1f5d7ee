#!/usr/bin/env bash
# One script a CUDA machine runs start to finish (a few minutes): the Triton kernels against
# the torch reference, time and bandwidth per block size, the hot-swap cost on the GPU, the
# engine's tokens with Triton and swaps against torch, and a calibration file.
#
#   bash bench/gpu_check.sh [OUT_DIR] [AZURE_TRACE_CSV]
#
# OUT_DIR (default: $OUT, else gpu-check-out in the repository) gets every step's log and the
# dated result files of bench/gpu_kernels.py and bench/hot_swap.py; AZURE_TRACE_CSV defaults
# to the Azure conversation trace beside the repository (../shared/traces/azure_llm_2023/).
#
# Works from a plain checkout with torch and triton installed (no `pip install` needed):
# the package is imported through a temporary `blocktune` link to the checkout. A machine
# without network access that lacks pydantic (needed by `blocktune calibrate`) can be given
# wheels in `.whl/` at the repository root (pydantic, pydantic-core, annotated-types,
# typing-inspection for its Python); they are installed into a temporary folder.
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$repo/gpu-check-out}}
trace=${2:-$repo/../shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv}
mkdir -p "$out"
pkg=$(mktemp -d)
ln -s "$repo" "$pkg/blocktune"
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
py=${PYTHON:-python3}
if ! "$py" -c "import pydantic" 2>/dev/null && compgen -G "$repo/.whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$pkg/site" "$repo"/.whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$pkg/site"
fi
status=0
step() {  # step NAME TIMEOUT COMMAND... : run, log to $out/NAME.log, remember failures
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "=== $name failed ($rc)"; status=1; }
}

step device 30 bash -c "nvidia-smi -L; $py -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, torch.cuda.get_device_name())'"
step kernel_tests 240 "$py" -m pytest -q -p no:cacheprovider --noconftest "$repo/tests/kernels/test_kernels.py"
step kernels 300 "$py" "$repo/bench/gpu_kernels.py" --csv "$out/kernels.csv" --results "$out"
if [ -f "$trace" ]; then
    step hot_swap 240 "$py" "$repo/bench/hot_swap.py" --device cuda --trace "$trace" --sizes-mb 64 256 1024 4096 --results "$out"
    step hot_swap_unaligned 240 "$py" "$repo/bench/hot_swap.py" --device cuda --trace "$trace" --sizes-mb 1024 --align 16 --results "$out"
else
    echo "=== hot_swap skipped: no trace at $trace"
fi
prompts="$out/prompts.jsonl"
"$py" - "$prompts" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(24):
        ids = [rng.randrange(256) for _ in range(rng.randint(5, 300))]
        f.write(json.dumps({"prompt_ids": ids, "max_tokens": rng.randint(8, 64)}) + "\n")
PY
gen=("$py" -m blocktune.tuner.cli generate --device cuda --prompts "$prompts" --block-size 16 --num-blocks 4096 --json)
step engine_torch 240 "${gen[@]}" --backend torch
step engine_triton 240 "${gen[@]}" --backend triton
step engine_triton_swaps 240 "${gen[@]}" --backend triton --swap-at 5:64 --swap-at 12:8 --swap-at 20:32 --swap-at 30:16
step engine_compare 30 "$py" - "$out" <<'PY'
import json, sys
def outputs(name):
    text = open(f"{sys.argv[1]}/{name}.log").read().strip().splitlines()[-1]
    return json.loads(text)
torch_run, triton_run, swapped = (outputs(n) for n in ("engine_torch", "engine_triton", "engine_triton_swaps"))
def same(a, b):
    return sum(x["token_ids"] == y["token_ids"] for x, y in zip(a["outputs"], b["outputs"]))
n = len(swapped["outputs"])
print(f"Triton with 4 swaps vs Triton without: {same(triton_run, swapped)}/{n} completions identical")
print(f"Triton vs torch backend (fp32, different kernels): {same(torch_run, triton_run)}/{n} identical")
for swap in swapped["swaps"]:
    print({k: swap[k] for k in ("status", "old_block_size", "new_block_size", "bytes_moved", "pause_s")})
sys.exit(0 if same(triton_run, swapped) == n else 1)
PY
step calibrate 300 "$py" -m blocktune.tuner.cli calibrate --device cuda --out "$out/calibration.yaml"
rm -rf "$pkg"
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo some steps failed), logs in $out"
exit $status
