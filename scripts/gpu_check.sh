#!/usr/bin/env bash
# The GPU check, for when a GPU is at hand (at most ~8 minutes on one GPU). Writes ONE report file:
#   1. the smoke suite (every notebook, PRESET=smoke) on the device; counts the notebooks that said "device: cuda";
#   2. scripts/gpu_check.py: one full-preset step time per objective (fp32 and bf16), the exact ACL-Grad gate vs
#      one batched VJP, the gate's bf16 vs fp32 angle, and the screened angle scope where the kit has it.
# Usage: bash scripts/gpu_check.sh [--device cuda|cpu] [--tiny] [--report FILE]
#   --device cpu hides the GPU (CUDA_VISIBLE_DEVICES=) so the notebooks' "auto" device is the CPU;
#   --tiny runs only notebook 00 and tiny shapes: how the test suite keeps this script from rotting.
# Exit status: 0 when every part passed, 1 otherwise (the report says which).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda TINY=0 REPORT=outputs/gpu_check/report.md
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --report) REPORT=$2; shift 2 ;;
    *) echo "unknown option $1; usage: bash scripts/gpu_check.sh [--device cuda|cpu] [--tiny] [--report FILE]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
if [ "$DEVICE" = cpu ]; then export CUDA_VISIBLE_DEVICES=""; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's acl_lab, also in the notebook kernels
mkdir -p "$(dirname "$REPORT")"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
FAILED=0
{
  echo "# acl_lab GPU check"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- command: bash scripts/gpu_check.sh --device $DEVICE$([ $TINY = 1 ] && echo ' --tiny')"
  echo "- $("$PY" -c 'import torch, acl_lab; from acl_lab.lab.notebook import device_line; print(f"acl_lab {acl_lab.__version__}, torch {torch.__version__}, cuda {torch.version.cuda}; {device_line()}")' 2>&1 | tail -1)"
  if command -v nvidia-smi >/dev/null; then echo "- nvidia-smi: $(nvidia-smi -L 2>&1 | head -2 | tr '\n' ' ')"; fi
  echo
} > "$REPORT"

# 1. the smoke suite on the device
NOTEBOOKS=()
[ "$TINY" = 1 ] && NOTEBOOKS=(--notebooks 00_tour)
T0=$(date +%s)
timeout 330 "$PY" -m acl_lab suite --preset smoke --output-dir "$WORK/suite" --no-resume "${NOTEBOOKS[@]}" > "$WORK/suite.log" 2>&1
RC=$?
ON_DEVICE=$(grep -l "device: ${DEVICE}" "$WORK"/suite/*.ipynb 2>/dev/null | wc -l)
RAN=$(ls "$WORK"/suite/*.ipynb 2>/dev/null | wc -l)
{
  echo "## 1. Smoke suite on $DEVICE: exit $RC in $(( $(date +%s) - T0 )) s; $ON_DEVICE of $RAN executed notebooks printed \"device: $DEVICE\""
  echo
  if [ -f "$WORK/suite/results.md" ]; then cut -c1-400 "$WORK/suite/results.md"; else tail -20 "$WORK/suite.log"; fi
  echo
} >> "$REPORT"
if [ "$RC" -ne 0 ] || [ "$ON_DEVICE" -ne "$RAN" ] || [ "$RAN" -eq 0 ]; then FAILED=1; tail -30 "$WORK/suite.log" >&2; fi

# 2-4. measurements
TINYARG=()
[ "$TINY" = 1 ] && TINYARG=(--tiny)
timeout 330 "$PY" scripts/gpu_check.py --device "$DEVICE" "${TINYARG[@]}" --report "$REPORT" || FAILED=1

echo "Total: $(( $(date +%s) - START )) s; $([ $FAILED = 0 ] && echo 'every part passed' || echo 'SOME PART FAILED (see above)')." >> "$REPORT"
echo "report: $REPORT"
exit $FAILED
