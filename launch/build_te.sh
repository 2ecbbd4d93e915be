#!/usr/bin/env bash
# Transformer Engine for megatron-rl's GPU path, offline: the prebuilt core library from PyPI,
# trimmed to the GPU architectures asked for, and TE's torch extension compiled against the
# installed torch into a wheel. Three steps, each usable alone:
#
#   launch/build_te.sh download [DIR]   # with network: the packages into DIR (default .te)
#   launch/build_te.sh prune [DIR]      # the core wheel with only NVTE_CUDA_ARCHS' cubins -> DIR/kit
#   launch/build_te.sh build [DIR]      # offline, on the GPU machine: the torch extension -> DIR/dist
#   launch/build_te.sh install [DIR]    # offline: pip install the kit and the built wheel
#
# Environment: TE_VERSION (2.20.2), NVTE_CUDA_ARCHS (90: the cubins kept by `prune`; `build` only
# uses it to decide whether the expert-parallel NCCL bindings are compiled, i.e. any arch >= 90),
# MAX_JOBS (parallel compile jobs; default: all cores), PYTHON (python3), TE_TARGET (install into
# this folder with `pip --target` instead of the running environment; add it to PYTHONPATH).
set -euo pipefail

TE_VERSION=${TE_VERSION:-2.20.2}
NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90}
PYTHON=${PYTHON:-python3}
step=${1:-}
dir=${2:-.te}
core_whl="transformer_engine_cu13-${TE_VERSION}-py3-none-manylinux_2_28_x86_64.whl"
meta_whl="transformer_engine-${TE_VERSION}-py3-none-any.whl"
sdist="transformer_engine_torch-${TE_VERSION}.tar.gz"

die() { echo "build_te.sh: $*" >&2; exit 1; }
need_file() { [ -f "$1" ] || die "missing $1: $2"; }

download() {
    mkdir -p "$dir"
    local plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dir" \
        "transformer-engine-cu13==$TE_VERSION" "transformer-engine==$TE_VERSION" "nvdlfw-inspect==0.2.2"
    # `pip download` of the sdist runs its setup.py, which needs torch: fetch the file itself.
    local url
    url=$(curl -fsSL https://pypi.org/simple/transformer-engine-torch/ \
        | grep -o "https://[^\"#]*/$sdist" | head -1) || true
    [ -n "$url" ] || die "no $sdist on PyPI's simple index (is TE_VERSION=$TE_VERSION right?)"
    curl -fsSL -o "$dir/$sdist" "$url"
    ls -l "$dir"
}

prune() {
    need_file "$dir/$core_whl" "run 'launch/build_te.sh download $dir' where PyPI is reachable"
    mkdir -p "$dir/kit"
    "$PYTHON" - "$dir/$core_whl" "$dir/kit/$core_whl" "$NVTE_CUDA_ARCHS" <<'PY'
# Keeps, in every fatbin container of the core library's .nv_fatbin section, only the cubins for
# the asked architectures (sm_90 keeps sm_90 and sm_90a). The kept entries move to the front of
# their container, the container's size shrinks and the freed bytes become zeros: no address in
# the library moves, and the zeros compress away. PTX entries are kept (the driver can JIT them).
import base64, hashlib, struct, sys, zipfile

src, dst, archs_env = sys.argv[1:]
archs = {int(a.strip().rstrip("af")) for a in archs_env.replace(",", ";").split(";") if a.strip()}
if not archs:
    sys.exit(f"build_te.sh: NVTE_CUDA_ARCHS={archs_env!r} names no architecture (e.g. 90 or 90;100)")
MAGIC, PTX = 0xBA55ED50, 1


def section(elf: bytes, name: bytes) -> tuple[int, int]:
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    str_off, = struct.unpack_from("<Q", elf, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        h = shoff + i * shentsize
        n, = struct.unpack_from("<I", elf, h)
        if elf[str_off + n:elf.index(b"\0", str_off + n)] == name:
            off, size = struct.unpack_from("<QQ", elf, h + 0x18)
            return off, size
    raise SystemExit(f"build_te.sh: no {name.decode()} section in the core library")


def prune(lib: bytearray) -> tuple[int, int, int]:
    off, size = section(bytes(lib), b".nv_fatbin")
    pos, kept, dropped, containers = off, 0, 0, 0
    while pos + 16 <= off + size:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", lib, pos)
        if magic != MAGIC:
            pos += 8
            continue
        containers += 1
        body, end = pos + hsz, pos + hsz + fsz
        entries, e = [], body
        while e < end:
            kind, _ev, ehs, psz = struct.unpack_from("<HHIQ", lib, e)
            arch, = struct.unpack_from("<I", lib, e + 28)
            entries.append((kind, arch, bytes(lib[e:e + ehs + psz])))
            e += ehs + psz
        if e != end:
            raise SystemExit("build_te.sh: unexpected fatbin layout; nothing was changed")
        keep = [b for k, a, b in entries if k == PTX or a in archs]
        if not keep:  # nothing for these GPUs here: leave the container whole
            keep = [b for _, _, b in entries]
        new = b"".join(keep)
        lib[body:end] = new + bytes(end - body - len(new))
        struct.pack_into("<Q", lib, pos + 8, len(new))
        kept += len(new)
        dropped += end - body - len(new)
        pos = end
    return containers, kept, dropped


zin = zipfile.ZipFile(src)
lib_name = next(n for n in zin.namelist() if n.endswith("/libtransformer_engine.so"))
lib = bytearray(zin.read(lib_name))
containers, kept, dropped = prune(lib)
digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(lib).digest()).rstrip(b"=").decode()
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
    for info in zin.infolist():
        data = bytes(lib) if info.filename == lib_name else zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            rows = [f"{lib_name},{digest},{len(lib)}" if r.startswith(lib_name + ",") else r
                    for r in data.decode().splitlines()]
            data = "".join(r + "\n" for r in rows).encode()
        zout.writestr(info, data)
print(f"{containers} fatbin containers: kept {kept / 2**20:.1f} MiB of cubins for sm_{sorted(archs)},"
      f" dropped {dropped / 2**20:.1f} MiB")
PY
    for f in "$meta_whl" "$sdist" nvdlfw_inspect-*.whl; do
        for g in "$dir"/$f; do [ -f "$g" ] && cp "$g" "$dir/kit/"; done
    done
    ls -l "$dir/kit"
}

build() {
    local kit="$dir/kit" src_dir
    [ -f "$kit/$sdist" ] || kit=$dir
    need_file "$kit/$sdist" "run 'launch/build_te.sh download' where PyPI is reachable, carry the file here"
    "$PYTHON" -c "import torch, torch.utils.cpp_extension" 2>/dev/null \
        || die "torch is not importable with $PYTHON: the extension is built against the installed torch"
    "$PYTHON" -c "import pybind11, setuptools, wheel, packaging" 2>/dev/null \
        || die "the build needs pybind11, setuptools, wheel and packaging installed for $PYTHON"
    command -v ninja >/dev/null || "$PYTHON" -c "import ninja" 2>/dev/null \
        || echo "build_te.sh: no ninja: the 33 sources compile one at a time (slow)" >&2
    local cuda=${CUDA_HOME:-/usr/local/cuda}
    [ -x "$cuda/bin/nvcc" ] || command -v nvcc >/dev/null \
        || die "no nvcc (CUDA_HOME=$cuda): TE's build reads the CUDA version and headers from the toolkit"
    export CUDA_HOME=$cuda
    # cudnn.h and nccl.h: from the toolkit, else from torch's nvidia-* wheels.
    local inc
    inc=$("$PYTHON" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia")
roots = [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
print(":".join(str(d) for r in roots for d in sorted(r.glob("*/include")) + sorted(r.glob("cu*/include"))))
PY
)
    export CPATH=${inc}${CPATH:+:$CPATH}
    src_dir=$(mktemp -d)
    tar -xzf "$kit/$sdist" -C "$src_dir"
    mkdir -p "$dir/dist"
    local out
    out=$(cd "$dir/dist" && pwd)
    echo "build_te.sh: building transformer_engine_torch $TE_VERSION against torch" \
        "$("$PYTHON" -c 'import torch; print(torch.__version__)') with MAX_JOBS=${MAX_JOBS:-all cores}"
    local t0=$SECONDS
    (cd "$src_dir/transformer_engine_torch-$TE_VERSION" \
        && NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=$NVTE_CUDA_ARCHS NVTE_PYTORCH_FORCE_BUILD=TRUE \
           NVTE_NO_LOCAL_VERSION=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
           "$PYTHON" -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$out" .) \
        || die "the extension's build failed (output above)"
    rm -rf "$src_dir"
    echo "build_te.sh: built in $((SECONDS - t0)) s:"; ls -l "$out"
}

install() {
    local kit="$dir/kit"
    need_file "$kit/$core_whl" "run 'launch/build_te.sh prune $dir' first (or copy the core wheel there)"
    need_file "$kit/$meta_whl" "run 'launch/build_te.sh download $dir' first"
    local ext
    ext=$(ls "$dir"/dist/transformer_engine_torch-"$TE_VERSION"-*.whl 2>/dev/null | head -1) || true
    [ -n "$ext" ] || die "no built extension in $dir/dist: run 'launch/build_te.sh build $dir' first"
    local where=()
    [ -n "${TE_TARGET:-}" ] && where=(--target "$TE_TARGET" --upgrade)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${where[@]}" \
        "$kit/$core_whl" "$kit/$meta_whl" "$ext" "$kit"/nvdlfw_inspect-*.whl
    echo "build_te.sh: installed; check with: $PYTHON -c 'import transformer_engine.pytorch'"
}

case "$step" in
    download) download ;;
    prune) prune ;;
    build) build ;;
    install) install ;;
    *) die "usage: launch/build_te.sh download|prune|build|install [DIR]  (see the header of this file)" ;;
esac
