#!/usr/bin/env bash
# Download every non-torch runtime dependency of graph_trainer as wheels, for an
# air-gapped GPU node (CPython 3.12, manylinux x86_64) that already has torch
# and triton installed.
#
#   bash scripts/offline_wheels.sh DIR                 # complete set, 58 wheels, ~132 MiB
#   MINIMAL=1 bash scripts/offline_wheels.sh DIR       # GPU bundle, 46 wheels, ~54 MiB
#   MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl   # + liger-kernel and pytest, ~57 MiB
#
# On the GPU node (no network):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site
#
# --no-deps + --target never touches the node's torch/triton: the wheels land in
# their own folder, which PYTHONPATH puts in front of site-packages (so the
# pinned fsspec / typing-extensions / filelock here shadow older ones there).
#
# The complete list is the import-time closure (Requires-Dist, markers evaluated
# for CPython 3.12 / Linux / x86_64) of
#   torchtitan==0.2.2 (incl. torchtitan.hf_datasets.text_datasets), tomli,
#   tensorboard, tokenizers, matplotlib
# minus torch and the part of torch's own closure that every torch install has
# (sympy, mpmath, networkx, jinja2, and setuptools on py>=3.12, which
# tensorboard lists but never imports).  filelock, fsspec, typing-extensions and
# markupsafe are torch deps too, but are pinned here anyway because datasets and
# anyio need particular versions (fsspec<=2026.2.0, typing_extensions>=4.16).
# tyro 1.0.17 no longer depends on rich or shtab, so neither is shipped.
#
# Environment knobs:
#   PYVER=3.12       target Python (PYVER=3.11 builds a set to test on a 3.11 box)
#   MINIMAL=1        the GPU bundle: what graph_trainer/torchtitan import at run
#                    time, nothing else.  Drops matplotlib and its deps, pillow
#                    (only torchtitan's flux/vlm models), hf-xet (Hub transfers),
#                    grpcio/markdown/werkzeug/tensorboard-data-server (only the
#                    TensorBoard *server*; SummaryWriter needs tensorboard, absl,
#                    protobuf, numpy - and torchtitan.components.metrics imports
#                    SummaryWriter, so tensorboard itself stays), and turns on
#                    SLIM=1 and LZMA=1.
#   BENCH=1          add liger-kernel (pure Python + Triton, ~0.7 MiB), so
#                    scripts/bench_rmsnorm.py can time its `liger` variant, and
#                    pytest, to run the GPU-only tests on the node
#   NO_NUMPY=1       skip numpy (if the node already has numpy>=2.0.2)
#   SLIM=1           repack pyarrow without Flight, S3, C++ headers, Cython
#                    sources, bundled tests and duplicate .so aliases, and
#                    tensorboard without its web-UI assets.  datasets and
#                    SummaryWriter use none of these.
#   LZMA=1           recompress every wheel's members with LZMA instead of
#                    deflate (zip method 14).  pip extracts wheels with Python's
#                    zipfile, which reads LZMA members (needs the stdlib lzma
#                    module, present in every normal CPython build).
#   CACHE=DIR        where pristine downloads are kept between runs
#                    (default ~/.cache/graph_trainer/wheels/cpXY)
#   PLATFORMS="..."  override the list of accepted manylinux platform tags
set -euo pipefail

DIR=${1:?usage: [MINIMAL=1] [PYVER=3.12] $0 DIR}
PYVER=${PYVER:-3.12}
PYTAG=cp${PYVER/./}
MINIMAL=${MINIMAL:-0}
NO_NUMPY=${NO_NUMPY:-0}
BENCH=${BENCH:-0}
SLIM=${SLIM:-$MINIMAL}
LZMA=${LZMA:-$MINIMAL}
CACHE=${CACHE:-$HOME/.cache/graph_trainer/wheels/$PYTAG}
PLATFORMS=${PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64"}

# --- pinned package list ----------------------------------------------------
# Imported at run time by torchtitan / graph_trainer (always shipped).
RUNTIME=(
  # torchtitan and its direct deps
  torchtitan==0.2.2
  torchdata==0.11.0
  tyro==1.0.17
  docstring-parser==0.18.0
  typeguard==4.6.0
  typing-extensions==4.16.0
  tomli==2.5.0
  einops==0.8.2
  tokenizers==0.23.3
  # datasets<4.8 and its import-time closure
  datasets==4.7.0
  dill==0.4.0
  multiprocess==0.70.18
  filelock==4.2.11
  fsspec==2026.2.0
  pyarrow==26.0.1
  pandas==3.1.1
  python-dateutil==2.9.0.post0
  six==1.17.0
  xxhash==4.1.0
  pyyaml==6.0.3
  tqdm==4.70.1
  packaging==26.2
  requests==2.34.2
  charset-normalizer==3.4.7
  idna==3.13
  urllib3==2.7.0
  certifi==2026.5.20
  huggingface-hub==1.33.0
  click==8.5.1
  httpx==0.28.1
  httpcore==1.0.9
  h11==0.16.0
  anyio==4.16.0
  # fsspec[http] (datasets asks for the extra and imports aiohttp)
  aiohttp==3.14.5
  aiohappyeyeballs==2.7.1
  aiosignal==1.4.0
  attrs==26.1.0
  frozenlist==1.8.0
  multidict==7.2.1
  propcache==0.5.4
  yarl==1.25.1
  # torch.utils.tensorboard.SummaryWriter (torchtitan.components.metrics)
  tensorboard==2.21.0
  absl-py==2.5.1
  protobuf==7.36.2
  markupsafe==3.0.3
)
NUMPY=(numpy==2.4.6)
# Declared dependencies that nothing imports on the training path.
DECLARED_ONLY=(
  pillow==13.0.0                 # torchtitan (flux / vlm models), tensorboard, matplotlib
  hf-xet==1.8.0                  # huggingface-hub, only for Hub up/downloads
  grpcio==1.85.1                 # tensorboard server
  markdown==3.11.3               # tensorboard server
  werkzeug==3.1.8                # tensorboard server
  tensorboard-data-server==0.7.2 # tensorboard server
)
MATPLOTLIB=(
  matplotlib==3.11.2
  contourpy==1.3.3
  cycler==0.12.1
  fonttools==4.68.0
  kiwisolver==1.5.1
  pyparsing==3.3.2
)

# Optional benchmark baselines and the test runner (BENCH=1); need only torch, triton, packaging.
BENCH_PKGS=(liger-kernel==0.8.5 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 pygments==2.20.0)

PKGS=("${RUNTIME[@]}")
if [[ $BENCH == 1 ]]; then PKGS+=("${BENCH_PKGS[@]}"); fi
if [[ $NO_NUMPY != 1 ]]; then PKGS+=("${NUMPY[@]}"); fi
if [[ $MINIMAL != 1 ]]; then PKGS+=("${DECLARED_ONLY[@]}" "${MATPLOTLIB[@]}"); fi

PLAT_ARGS=()
for p in $PLATFORMS; do PLAT_ARGS+=(--platform "$p"); done

# --- download (pristine copies go to $CACHE) ----------------------------------
mkdir -p "$CACHE" "$DIR"
echo "Fetching ${#PKGS[@]} packages for CPython $PYVER (manylinux x86_64) into $CACHE"
for spec in "${PKGS[@]}"; do
  # (the grep only hides noise about unreachable extra indexes of some pip configs)
  python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp "${PLAT_ARGS[@]}" \
    -d "$CACHE" "$spec" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  [[ ${PIPESTATUS[0]} == 0 ]] || { echo "pip download failed for $spec" >&2; exit 1; }
done

# --- assemble $DIR: exactly one wheel per pinned package ------------------------
python3 - "$CACHE" "$DIR" "$PYTAG" "$SLIM" "$LZMA" "${PKGS[@]}" <<'PY'
import base64, hashlib, os, re, shutil, sys, zipfile
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

cache, out, pytag = sys.argv[1:4]
slim, lzma = sys.argv[4] == "1", sys.argv[5] == "1"
pins = {}
for spec in sys.argv[6:]:
    name, ver = spec.split("==")
    pins[canonicalize_name(name)] = Version(ver)

def usable(tags):
    # py3-none-any, py312-none-any, cp312-cp312-*, cp3x-abi3-*
    ok = ("py3", pytag, "py" + pytag[2:])
    return any(t.interpreter in ok or t.abi == "abi3" for t in tags)

chosen = {}
for f in sorted(os.listdir(cache)):
    if f.endswith(".whl"):
        name, ver, _, tags = parse_wheel_filename(f)
        if pins.get(name) == ver and usable(tags):
            chosen.setdefault(name, f)
missing = sorted(set(pins) - set(chosen))
if missing:
    sys.exit(f"missing wheels: {missing}")

# Start from an empty set of wheels so DIR never holds two versions of one package.
for f in os.listdir(out):
    if f.endswith(".whl"):
        os.remove(os.path.join(out, f))


def pyarrow_drop(names):
    """Members of the pyarrow wheel that `datasets` never loads."""
    names = set(names)
    def drop(n):
        low = n.lower()
        if any(k in low for k in ("flight", "libarrow_s3", "_s3fs", "/include/",
                                  "pyarrow/tests/", "pyarrow/src/", "_pyarrow_cpp_tests")):
            return True
        if low.endswith((".pyx", ".pxd", ".pxi", ".h", ".hpp", ".cmake")):
            return True
        # libfoo.so and libfoo.so.2600.1.0 are link-time aliases of libfoo.so.2600,
        # which is the SONAME every extension module actually loads.
        m = re.match(r"(.*\.so)(\.\d+)(\.\d+\.\d+)$", n)
        if m and m.group(1) + m.group(2) in names:
            return True
        if n.endswith(".so") and any(re.fullmatch(re.escape(n) + r"\.\d+", o) for o in names):
            return True
        return False
    return drop


def tensorboard_drop(names):
    """The web UI assets: SummaryWriter does not need them."""
    return lambda n: n.endswith(("tensorboard/webfiles.zip", "projector_binary.js",
                                 "projector_binary.html"))


def rewrite(src, dst, drop=None, method=zipfile.ZIP_DEFLATED):
    """Copy a wheel, leaving out members and/or changing compression; RECORD is rebuilt."""
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        keep = [n for n in names if not (drop and drop(n))]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        kw = {"compresslevel": 9} if method == zipfile.ZIP_DEFLATED else {}
        with zipfile.ZipFile(dst, "w", method, **kw) as zout:
            for info in zin.infolist():
                n = info.filename
                if n == record or n not in keep:
                    continue
                data = zin.read(n)
                zi = zipfile.ZipInfo(n, info.date_time)
                zi.external_attr = info.external_attr
                zi.compress_type = method
                zout.writestr(zi, data, **kw)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                rows.append(f"{n},sha256={digest.decode()},{len(data)}")
            rows.append(f"{record},,")
            zout.writestr(record, "\n".join(rows) + "\n")
    return len(names) - len(keep)


slimmers = {"pyarrow": pyarrow_drop, "tensorboard": tensorboard_drop}
for name, f in sorted(chosen.items()):
    src, dst = os.path.join(cache, f), os.path.join(out, f)
    drop = None
    if slim and name in slimmers:
        with zipfile.ZipFile(src) as z:
            drop = slimmers[name](z.namelist())
    if drop is None and not lzma:
        shutil.copyfile(src, dst)
        continue
    dropped = rewrite(src, dst, drop, zipfile.ZIP_LZMA if lzma else zipfile.ZIP_DEFLATED)
    a, b = os.path.getsize(src), os.path.getsize(dst)
    if drop is not None or a > 2**20:
        what = f"dropped {dropped} members, " if drop is not None else ""
        print(f"  {f.split('-')[0]:<12} {what}{a / 2**20:6.1f} -> {b / 2**20:6.1f} MiB")
PY

echo
echo "Wheels in $DIR (MiB):"
for f in "$DIR"/*.whl; do stat -c '%s %n' "$f"; done | sort -n -r \
  | awk '{printf "  %7.2f  %s\n", $1/1048576, $2}'
du -cb "$DIR"/*.whl | tail -1 \
  | awk -v n="$(ls "$DIR"/*.whl | wc -l)" '{printf "Total: %.1f MiB in %d wheels\n", $1/1048576, n}'
echo
echo "Install offline (leaves torch alone):"
if [[ $LZMA == 1 ]]; then echo "  (LZMA-compressed wheels: the node's python3 needs the stdlib lzma module)"; fi
echo "  python3 -m pip install -q --no-index --no-deps --target /tmp/site $DIR/*.whl && export PYTHONPATH=/tmp/site"
