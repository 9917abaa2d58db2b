# The README's two commands:
#   make demo   builds ampfuse in place (editable) and runs a short mixed-precision training demo
#   make test   runs every test: the style check (make lint), the C++ kernel tests, pytest
#               against the wheel as users install it (built by `make wheel`, installed with a
#               PATH that has no compiler), the docs
# Both create the Python environment on first use and reuse it afterwards, so
# torch (about 3 GB) is downloaded once per machine.
#   make wheel  the wheel alone, into dist/ (git-ignored)

PYTHON ?= python3
PYVER := $(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
VENV ?= $(HOME)/.cache/ampfuse/venv-torch2.11-py$(PYVER)
VPY := $(VENV)/bin/python
# The venv's cmake and ninja come first; nvcc is found on PATH or in /usr/local/cuda.
export PATH := $(VENV)/bin:$(PATH):/usr/local/cuda/bin
MAX_JOBS ?= 2
export MAX_JOBS

.PHONY: demo test build wheel install-wheel env cpp-test py-test docs bench clean lint format

demo: build
	$(VPY) -m ampfuse demo

test: lint cpp-test py-test docs

env: $(VPY)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt

$(VPY):
	mkdir -p $(dir $(VENV))
	$(PYTHON) -m venv $(VENV)

build: env
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .

# The wheel for every Python and every GPU architecture torch's wheels cover (CMakeLists.txt);
# TORCH_CUDA_ARCH_LIST narrows it. Against the venv's torch, hence --no-build-isolation.
wheel: env
	rm -f dist/ampfuse-*.whl
	$(VPY) -m pip wheel --quiet --disable-pip-version-check --no-build-isolation --no-deps \
	  --wheel-dir dist .
	@$(VPY) -c "import glob, json, os, zipfile; w = glob.glob('dist/ampfuse-*.whl')[0]; \
	  info = json.loads(zipfile.ZipFile(w).read('ampfuse/ops/build_info.json')); \
	  print(f'{w}: {os.path.getsize(w) / 2**20:.0f} MB, for torch {info[\"torch\"]}, CUDA code for', \
	        info['cuda_architectures'] or 'none (CPU only)', '- sources', info['source_digest'])"

# Installs the wheel as a user would: plain `pip install`, with a PATH that holds the venv's
# Python and no compiler at all (the check fails loudly if one is there).
NO_COMPILER_PATH := $(VENV)/bin
install-wheel: wheel
	@for tool in cc gcc g++ c++ clang nvcc; do \
	  if (PATH=$(NO_COMPILER_PATH); command -v $$tool >/dev/null); then \
	    echo "error: $$tool is on the install PATH $(NO_COMPILER_PATH)"; exit 1; fi; done
	$(VPY) -m pip uninstall --quiet --disable-pip-version-check -y ampfuse
	env -u CC -u CXX -u CUDACXX PATH=$(NO_COMPILER_PATH) \
	  $(VPY) -m pip install --quiet --disable-pip-version-check dist/ampfuse-*.whl

# The kernel tests build only the torch-free kernels library (no op library, no extension).
# Their CUDA half runs only on a GPU machine (benchmarks/gpu_check.sh builds it for its GPU);
# here it is compiled and linked for one architecture, the wheel build compiles them all.
cpp-test: env catch2
	cmake -S . -B build/cpp-tests -G Ninja -DAMPFUSE_BUILD_OPS=OFF -DAMPFUSE_BUILD_STEP_SCAN=OFF \
	  -DAMPFUSE_BUILD_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES=75-real
	cmake --build build/cpp-tests -j $(MAX_JOBS)
	ctest --test-dir build/cpp-tests --output-on-failure

# Against the installed wheel: python/ is not on sys.path (pytest runs from the checkout, whose
# pyproject sets no pythonpath), and the first line checks where ampfuse comes from.
py-test: install-wheel
	cd tests && $(VPY) -c "import ampfuse, sys; f = ampfuse.__file__; print('testing', ampfuse.__version__, 'from', f); sys.exit('site-packages' not in f)"
	$(VPY) -m pytest tests/python -q

# The docs site (mkdocs.yml, docs/) into site/ (git-ignored), warnings as errors: a broken link
# or anchor fails. The API pages read the docstrings statically, so no build of ampfuse is needed.
docs: env
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --site-dir site

# Style (shared/STYLE.md's habits): clang-format (.clang-format: Google, 100 columns) for the C++
# and CUDA sources, ruff (pyproject.toml's [tool.ruff]) for the Python; both pinned in
# requirements-dev.txt so that every machine formats alike. `make format` rewrites, `make lint`
# (run first by `make test`) only checks.
CXX_SOURCES = $(shell find csrc tests/cpp benchmarks -name '*.cpp' -o -name '*.h' -o -name '*.cu' \
  -o -name '*.cuh' -o -name '*.inc')
PY_SOURCES = python tests benchmarks cmake setup.py

lint: env
	@echo "lint: clang-format on $(words $(CXX_SOURCES)) C++/CUDA files, ruff on $(PY_SOURCES)"
	@$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES) || { \
	  echo "error: C++ sources not formatted; 'make format' rewrites them"; exit 1; }
	@$(VENV)/bin/ruff check --quiet $(PY_SOURCES)

format: env
	@echo "format: clang-format -i on $(words $(CXX_SOURCES)) C++/CUDA files," \
	  "ruff --fix on $(PY_SOURCES)"
	@$(VENV)/bin/clang-format -i $(CXX_SOURCES)
	@$(VENV)/bin/ruff check --quiet --fix $(PY_SOURCES)

bench: build
	$(VPY) benchmarks/run.py

.PHONY: catch2
catch2:
	@test -f /usr/include/catch2/catch.hpp || { \
	  echo "Installing Debian's catch2 for the C++ tests"; \
	  apt-get update -qq && apt-get install -y -qq catch2 >/dev/null; } || { \
	  echo "error: the C++ tests need Catch2 2.x: run 'apt-get install catch2' as root"; exit 1; }

# The GPU machine has no network, no Catch2 and no expecttest (which torch.testing._internal,
# and so two of the CUDA test files, import): this downloads Debian's catch2 package and the
# wheels of expecttest and of pytest-xdist (with execnet: the CUDA tests in 4 processes) into
# .gpu/ (git-ignored) for benchmarks/gpu_check.sh, which unpacks the package with dpkg -x and
# installs the wheels into a folder of its own; and torchao's wheel into .gpu/wheels/ for the
# torchao float8 rows of the FP8 benchmarks (0.17.0 needs torch >= 2.11; a cp310-abi3 wheel, so
# it installs on the GPU machine's Python 3.12).
.PHONY: gpu-deps
gpu-deps: env
	mkdir -p .gpu
	rm -f .gpu/catch2_*.deb .gpu/*.whl
	cd .gpu && apt-get download catch2
	$(VPY) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --dest .gpu expecttest pytest-xdist execnet
	$(VPY) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --dest .gpu/wheels torchao==0.17.0

clean:
	rm -rf build dist python/ampfuse/ops/libampfuse_ops.so python/ampfuse/ops/_step_scan*.so \
	  python/ampfuse/ops/build_info.json
