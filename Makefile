# Two commands are the contract: `make demo` and `make test`. Both do all set-up on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.silverrec-setup

.PHONY: setup predictor demo test test-portable test-gpu bench bench-serve lock clean

setup: $(STAMP)

# CPU builds only, every version pinned by requirements.lock (the exact dependency closure; regenerate
# with `make lock`, tests/test_lock.py checks it against pyproject.toml): torch 2.13.0+cpu from local
# disk, fbgemm-gpu-cpu instead of the CUDA fbgemm-gpu that torchrec declares, so the whole lock goes in
# with --no-deps (torchrec included, as before); then silverrec itself in editable mode (setup.py
# compiles the operator library, kernels/csrc/, into kernels/libsilverrec_ops.so: every op's schema, CPU and
# Meta kernel; it needs a C++17 compiler, without which no silverrec op exists).
$(STAMP): pyproject.toml requirements.lock setup.py Makefile $(wildcard kernels/csrc/*) $(wildcard predictor/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import silverrec, torchrec, fbgemm_gpu; from silverrec.kernels import library; print('silverrec', silverrec.__version__, 'ready; operators:', library.load(), library.host().isa())"
	$(MAKE) --no-print-directory predictor
	touch $(STAMP)

# silverrec-predictor (predictor/: the C++ program that serves a snapshot without Python), built with CMake against
# the venv's libtorch and the operator library, installed as .venv/bin/silverrec-predictor. Skipped, saying why,
# where CMake, a C++ compiler or its libraries (OpenSSL, nlohmann-json, cpp-httplib) are missing: Python's
# predictor does not need it (tests/test_predictor.py skips then).
PREDICTOR_BUILD := build/predictor
predictor:
	@if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then \
		echo "silverrec-predictor skipped: no CMake or C++ compiler found"; exit 0; fi; \
	mkdir -p $(PREDICTOR_BUILD); \
	if ! cmake -S predictor -B $(PREDICTOR_BUILD) -DCMAKE_BUILD_TYPE=Release \
		-DCMAKE_PREFIX_PATH="$$($(BIN)/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
		> $(PREDICTOR_BUILD)/configure.log 2>&1; then \
		echo "silverrec-predictor skipped: CMake could not configure it (see $(PREDICTOR_BUILD)/configure.log):"; \
		grep -m3 -E "Error|Could not|not found|NOT" $(PREDICTOR_BUILD)/configure.log; exit 0; fi; \
	cmake --build $(PREDICTOR_BUILD) -j2 && install -m 755 $(PREDICTOR_BUILD)/silverrec-predictor $(BIN)/silverrec-predictor \
		&& echo "silverrec-predictor installed: $(BIN)/silverrec-predictor"

demo: setup
	$(BIN)/python -m silverrec.publish.demo

test: setup
	$(BIN)/python -m pytest -q tests
	$(MAKE) test-portable

# The C++ kernels' other code paths (kernels/csrc: AVX-512 with VNNI, AVX-512 without it, AVX2, SSE), of
# which a machine runs only its own under -march=native: each instruction set (ISAS, gcc -march names)
# is built under build/portable/ (SILVERREC_MARCH) and the kernel tests run on that build
# (SILVERREC_OPS_PATH; test_the_build_under_test_is_loaded checks it is loaded and its ISA). `make test`
# covers x86-64-v4 (AVX-512 without VNNI: Skylake-X) and x86-64-v3 (AVX2: Zen 2/3, Haswell), ~2 min each;
# add x86-64-v2 (SSE4.2: the scalar paths) with `make test-portable ISAS="x86-64-v4 x86-64-v3 x86-64-v2"`.
# These runs use OMP_WAIT_POLICY=PASSIVE, silverrec's default, under which the ops' parallel steps run on
# their helper team (kernels/csrc/team.h); the main suite imports torch first, so its steps run on OpenMP.
ISAS ?= x86-64-v4 x86-64-v3
PORTABLE_TESTS := tests/test_cpu_scan.py tests/test_filtered_topk.py tests/test_rescore_rows.py \
	tests/test_search_fast_paths.py tests/test_filter_routes.py tests/test_mol_score.py tests/test_candidate_rows.py \
	tests/test_residual_codes.py tests/test_bloom_filter.py tests/test_team.py \
	tests/test_centroid_probe.py tests/test_beam_topk.py tests/test_staged_attention.py
test-portable: setup
	@set -e; mkdir -p build/portable; for march in $(ISAS); do \
		case $$march in x86-64-v4) isa=avx512;; x86-64-v3) isa=avx2;; x86-64-v2) isa=sse;; *) isa=;; esac; \
		echo "building the C++ kernels for -march=$$march ($${isa:-any ISA})"; \
		SILVERREC_MARCH=$$march $(BIN)/python setup.py -q build_ext --build-lib build/portable/$$march \
			--build-temp build/portable/$$march-obj > build/portable/$$march.log 2>&1 \
			|| { tail -30 build/portable/$$march.log; exit 1; }; \
		SILVERREC_OPS_PATH=$(CURDIR)/build/portable/$$march/silverrec/kernels/libsilverrec_ops.so OMP_WAIT_POLICY=PASSIVE \
			SILVERREC_EXPECT_ISA=$$isa $(BIN)/python -m pytest -q -p no:cacheprovider $(PORTABLE_TESTS); \
	done

# The GPU suite (tests/gpu; docs/gpu.md): on a machine whose python3 already has torch and triton, with
# no venv, no install and no network (tools/repo_import.py maps pyproject's package folders); the operator
# library is built against that torch under build/gpu/ first. Triton compiles for the device (no
# TRITON_INTERPRET); every test skips without CUDA.
test-gpu:
	$(PY) setup.py -q build_ext --build-lib build/gpu --build-temp build/gpu-obj
	SILVERREC_OPS_PATH=$(CURDIR)/build/gpu/silverrec/kernels/libsilverrec_ops.so SILVERREC_GPU_TESTS=1 SILVERREC_QUIET=1 \
		$(PY) -m pytest -q tests/gpu

# The search a published pure-ANN snapshot runs (the index's forward, and silverrec.load(DIR).search on the
# snapshot) against Faiss IVF-Flat / IVF-SQ8 and hnswlib on the same data, in benchmarks/ann.py's quick mode
# (100k items + MovieLens; results/ann_quick.json). The full run: benchmarks/ann.py without --quick.
bench: setup
	$(BIN)/python benchmarks/ann.py --quick

# Load test of silverrec serve (benchmarks/serve.py): wrk (Debian's package) drives it, Ray Serve is
# the peer: ray goes into its own venv (.venv/ray) that sees this one's packages, so its pins never
# touch the project's.
bench-serve: setup
	command -v wrk >/dev/null 2>&1 || apt-get install -y wrk || { apt-get update && apt-get install -y wrk; }
	test -x $(VENV)/ray/bin/python || $(PY) -m venv $(VENV)/ray
	$(VENV)/ray/bin/pip install -q --disable-pip-version-check "ray[serve]"
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python3.11/site-packages')" \
		> $(VENV)/ray/lib/python3.11/site-packages/zz_silverrec_main.pth
	$(BIN)/python benchmarks/serve.py

# Rewrite requirements.lock from .venv after a dependency change: edit pyproject.toml, pip install the
# new package into .venv, then `make lock` (tools/lock.py: pyproject's closure, exact versions).
lock:
	$(BIN)/python tools/lock.py

clean:
	rm -rf $(VENV) build *.egg-info kernels/libsilverrec_ops.so
