#!/usr/bin/env bash
# Build llama.cpp's `llama-server`, a benchmark-only peer of metrale, from the llama.cpp source
# vendored in the llama-cpp-python sdist on PyPI. Nothing of llama.cpp is committed: the sdist, the
# source and the build go under DEST (default benchmarks/peers/llama.cpp/, git-ignored). A finished
# build is reused. The last line printed is the path of the binary.
#
#   bash benchmarks/peers/build_llama_server.sh [DEST]     # ~10-15 min on 2 cores
#
# Environment:
#   LLAMA_CPP_BUILD=portable  (default) GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS: one CPU backend per
#                             ISA level (x64 ... zen4), the best one the CPU has is loaded at start,
#                             so the binary runs on any x86-64 machine (no SIGILL when the CPU differs)
#   LLAMA_CPP_BUILD=avx512    one static backend, AVX-512 F/BW/DQ/VL/CD + VBMI + VNNI + BF16 (Zen 4,
#                             Sapphire Rapids); dies with SIGILL on older CPUs
#   LLAMA_CPP_BUILD=avx2      one static backend, AVX2 + FMA + F16C + BMI2 (Haswell and later)
#   LLAMA_CPP_PYTHON_VERSION  the sdist version (default 0.3.36: llama.cpp 0c1e570, ggml 0.25.3)
#   PYTHON                    the Python whose pip downloads the sdist (default python3)
#   JOBS                      parallel compile jobs (default: the number of CPUs)
#
# Never -march=native (GGML_NATIVE=OFF), AMX off (the portable build drops its sapphirerapids
# variant, the only one with AMX; such a CPU loads the zen4 variant), no web UI (the default would
# download one at build time), no OpenSSL, no tests or examples.
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
KIND=${LLAMA_CPP_BUILD:-portable}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(getconf _NPROCESSORS_ONLN)}
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=$(mkdir -p "${1:-$HERE/llama.cpp}" && cd "${1:-$HERE/llama.cpp}" && pwd)
BUILD=$DEST/build-$KIND
BIN=$BUILD/bin/llama-server

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "llama-server already built ($KIND): $BIN" >&2
  echo "$BIN"
  exit 0
fi

case $KIND in
  portable) ISA=(-DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DBUILD_SHARED_LIBS=ON) ;;
  avx512)   ISA=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                 -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
  avx2)     ISA=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF) ;;
  *) echo "LLAMA_CPP_BUILD must be portable, avx512 or avx2, got '$KIND'" >&2; exit 2 ;;
esac
for tool in cmake c++ tar; do
  command -v "$tool" >/dev/null || { echo "building llama-server needs $tool (apt-get install cmake g++)" >&2; exit 1; }
done

SDIST=$DEST/sdist/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
  echo "downloading the llama-cpp-python $VERSION sdist into $DEST/sdist" >&2
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST/sdist" >&2
fi
SRC=$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp
[ -f "$SRC/CMakeLists.txt" ] || tar xzf "$SDIST" -C "$DEST"

echo "configuring llama.cpp ($KIND) in $BUILD" >&2
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${ISA[@]}" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  > "$DEST/configure-$KIND.log"
echo "building llama-server with $JOBS jobs (about 10-15 min on 2 cores); log: $DEST/build-$KIND.log" >&2
start=$(date +%s)
cmake --build "$BUILD" --target llama-server -j "$JOBS" > "$DEST/build-$KIND.log" 2>&1 \
  || { tail -30 "$DEST/build-$KIND.log" >&2; exit 1; }
rm -f "$BUILD"/bin/libggml-cpu-sapphirerapids.so  # the AMX variant (see above)
"$BIN" --version >&2
echo "built in $(( $(date +%s) - start )) s" >&2
echo "$BIN"
