# The README's two commands:
#   make demo   builds ampfuse and runs a short mixed-precision training demo
#   make test   builds ampfuse and runs every test (C++ kernel tests, pytest, the docs build)
# Both create the Python environment on first use and reuse it afterwards, so
# torch (about 3 GB) is downloaded once per machine.

PYTHON ?= python3
PYVER := $(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
VENV ?= $(HOME)/.cache/ampfuse/venv-torch2.11-py$(PYVER)
VPY := $(VENV)/bin/python
# The venv's cmake and ninja come first; nvcc is found on PATH or in /usr/local/cuda.
export PATH := $(VENV)/bin:$(PATH):/usr/local/cuda/bin
MAX_JOBS ?= 2
export MAX_JOBS

.PHONY: demo test build env cpp-test py-test docs bench clean

demo: build
	$(VPY) -m ampfuse demo

test: cpp-test py-test docs

env: $(VPY)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt

$(VPY):
	mkdir -p $(dir $(VENV))
	$(PYTHON) -m venv $(VENV)

build: env
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .

# The kernel tests build only the torch-free kernels library (no extension module).
cpp-test: env catch2
	cmake -S . -B build/cpp-tests -G Ninja -DAMPFUSE_BUILD_PYTHON_MODULE=OFF -DAMPFUSE_BUILD_TESTS=ON
	cmake --build build/cpp-tests -j $(MAX_JOBS)
	ctest --test-dir build/cpp-tests --output-on-failure

py-test: build
	$(VPY) -m pytest tests/python -q

# The docs site (mkdocs.yml, docs/) into site/ (git-ignored), warnings as errors: a broken link
# or anchor fails. The API pages read the docstrings statically, so no build of ampfuse is needed.
docs: env
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --site-dir site

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
# installs the wheels into a folder of its own.
.PHONY: gpu-deps
gpu-deps: env
	mkdir -p .gpu
	rm -f .gpu/catch2_*.deb .gpu/*.whl
	cd .gpu && apt-get download catch2
	$(VPY) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --dest .gpu expecttest pytest-xdist execnet

clean:
	rm -rf build python/ampfuse/_C*.so
