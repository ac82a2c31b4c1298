#!/usr/bin/env bash
# One prepared device check of pallas_kernels on a GPU machine (written for one NVIDIA H200).
#
#   bash benchmarks/device_check.sh          # from the repository root
#
# 1. records the environment (GPU, driver, jax, devices)              -> $OUT/env.txt
# 2. runs tests/pallas_kernels with the compiled Triton kernels        -> $OUT/tests.txt, tests.xml
#    (PALLAS_KERNELS_TEST_BACKENDS=gpu, PALLAS_KERNELS_TEST_INTERPRET=0), at most $TESTS_TIMEOUT s
#    (default 240); in 4 pytest-xdist workers when xdist is installed (Triton compiles on the CPU),
#    without tests/conftest.py (it imports hkv's engine, which these tests do not need)
# 3. runs benchmarks/decode_kernels.py at DeepSeek-V4-Flash shapes, batch 32,
#    1K/8K/64K context, with kernel-vs-reference checks and a block-size sweep, at most
#    $BENCH_TIMEOUT s (default 300)                                   -> $OUT/bench.txt
# 4. the end-to-end decode benchmark: benchmarks/generation.py --quick --parts decode (tiny
#    DeepSeek-V4, engine vs hand-written decode_loop vs per-token loop, greedy tokens compared),
#    batches $DECODE_BATCHES (default 1,8), at most $DECODE_TIMEOUT s (default 240; 0 skips it)
#                                                                      -> $OUT/decode.txt
#    then the same at batch 8 with XLA's command buffers (CUDA graphs) also capturing the decode
#    loop's while loops and conditionals (`--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`,
#    `--xla_gpu_graph_min_graph_size=1`): GPU decode was launch-bound on the first H200 run (~1,130
#    kernels per token of the tiny model), which graphs replay without a launch each; at most
#    $DECODE_GRAPH_TIMEOUT s (default 150; 0 skips it)                 -> $OUT/decode_graphs.txt
# 5. writes the lines worth copying into benchmarks/README.md          -> $OUT/summary.txt
#
# Installs nothing: it needs a Python with jax (CUDA), numpy and pytest (hypothesis optional; flax,
# orbax-checkpoint and tensorstore for step 4); set PYTHON=... to choose one. OUT defaults to
# ./out/device_check. About 3 minutes on an H200 (2026-12-04), plus ~1-2 for step 4's command-buffer
# run (new since); every stage writes its output as it goes, so a stage stopped at its limit still
# leaves what it printed.
# Exit status: 0 if tests and checks passed, 1 otherwise, 2 if no GPU was found.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/device_check}"
mkdir -p "$OUT"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-240}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-300}"
DECODE_TIMEOUT="${DECODE_TIMEOUT:-240}"
DECODE_BATCHES="${DECODE_BATCHES:-1,8}"
DECODE_GRAPH_TIMEOUT="${DECODE_GRAPH_TIMEOUT:-150}"
export PYTHONUNBUFFERED=1
# The repository's packages (hkv, models, pallas_kernels) without installing them.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import jax" >/dev/null 2>&1; then
      PY="$candidate"
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "no python with jax found; set PYTHON=..." | tee "$OUT/summary.txt"
  exit 2
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l | tr -d ' ') changed files"
  echo "python: $PY ($("$PY" --version 2>&1))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1 || true
  "$PY" - <<'EOF'
import jax, jaxlib
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("default backend:", jax.default_backend())
print("devices:", jax.devices())
import importlib.metadata as md
for name in ("flax", "orbax-checkpoint", "tensorstore", "numpy", "triton", "pytest", "pytest-xdist", "hypothesis"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)" != "gpu" ]; then
  echo "jax sees no GPU: nothing to check (see $OUT/env.txt)" | tee "$OUT/summary.txt"
  exit 2
fi

status=0

# 2. Tests with the compiled kernels (the TPU kernels are not run here; their lowering is).
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  workers=()
  # Each worker allocates GPU memory as it goes (no 75% preallocation per process).
  "$PY" -c "import xdist" >/dev/null 2>&1 && workers=(-n 4)
  XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_KERNELS_TEST_BACKENDS=gpu PALLAS_KERNELS_TEST_INTERPRET=0 \
    timeout "$TESTS_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider --noconftest -rfE ${workers[@]+"${workers[@]}"} \
      tests/pallas_kernels --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "pytest is not installed: tests skipped" | tee "$OUT/tests.txt"
  status=1
fi

# 3. Benchmark + kernel-vs-reference checks at DeepSeek-V4-Flash shapes.
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout "$BENCH_TIMEOUT" "$PY" benchmarks/decode_kernels.py \
  --batch 32 --contexts 1024,8192,65536 --check --sweep --peak-tbps 4.8 2>&1 | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 4. End-to-end decode: the engine's on-device loop vs a hand-written decode_loop vs per-token.
if [ "$DECODE_TIMEOUT" -gt 0 ]; then
  timeout "$DECODE_TIMEOUT" "$PY" benchmarks/generation.py --quick --parts decode --batches "$DECODE_BATCHES" \
    --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$DECODE_GRAPH_TIMEOUT" -gt 0 ]; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
    timeout "$DECODE_GRAPH_TIMEOUT" "$PY" benchmarks/generation.py --quick --parts decode --batches 8 \
    --json "$OUT/decode_graphs.json" 2>&1 | tee "$OUT/decode_graphs.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# 5. Summary.
{
  echo "== device check $(date -u +%Y-%m-%d), exit status $status =="
  grep -m1 -E "^NVIDIA|name" "$OUT/env.txt" || true
  grep -E "^jax " "$OUT/env.txt" || true
  echo "-- tests (compiled Triton kernels):"
  tail -n 3 "$OUT/tests.txt"
  echo "-- checks:"
  grep -E "^check |^# checks" "$OUT/bench.txt" || echo "(none: benchmark did not get that far)"
  echo "-- kernel vs XLA reference, bandwidth:"
  grep -E "reference/kernel" "$OUT/bench.txt" || true
  echo "-- step time growth:"
  grep -A8 -E "^# step time" "$OUT/bench.txt" || true
  echo "-- CSA block-size sweep:"
  grep -A8 -E "^# CSA attention kernel sweep" "$OUT/bench.txt" || true
  if [ -f "$OUT/decode.txt" ]; then
    echo "-- end-to-end decode (benchmarks/generation.py --quick --parts decode):"
    grep -A12 -E "^decode tokens/s" "$OUT/decode.txt" || tail -n 5 "$OUT/decode.txt"
  fi
  if [ -f "$OUT/decode_graphs.txt" ]; then
    echo "-- the same at batch 8 with command buffers capturing while loops and conditionals:"
    grep -A12 -E "^decode tokens/s" "$OUT/decode_graphs.txt" || tail -n 5 "$OUT/decode_graphs.txt"
  fi
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status
