# Two commands: `make demo` and `make test`. Each sets up what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel; on a GPU node use e.g. `make demo TORCH=torch` to take your CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# bench/peers.py's own environment: the project plus the peers (mosaicml-streaming, litdata,
# s3torchconnector, webdataset, matplotlib), never installed into .venv.
PEERS_VENV  ?= .venv-peers
PEERS_PY    := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_PINS  := bench/peers-constraints.txt

.PHONY: demo test check lint types unit venv-peers bench bench-small bench-peers bench-peers-small soak gpu-check deploy-lint deploy-check compose-check system-deps test-rgw clean

$(STAMP): pyproject.toml client/pyproject.toml client/setup.py client/csrc/_gather.c client/csrc/_tarscan.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ./client -e '.[test]'
	touch $@

venv: $(STAMP)

# mosaicml-streaming and litdata go in with --no-deps: both require torchvision, whose only
# wheel for torch 2.13.0 is a CUDA build that fails to import on the CPU torch; their runtime
# dependencies are the peers extra (pyproject.toml; bench/peers-constraints.txt says more).
$(PEERS_STAMP): pyproject.toml client/pyproject.toml client/setup.py client/csrc/_gather.c client/csrc/_tarscan.c $(PEERS_PINS)
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install -q --upgrade pip
	$(PEERS_PY) -m pip install -q -c $(PEERS_PINS) "$(TORCH)"
	$(PEERS_PY) -m pip install -q -c $(PEERS_PINS) -e ./client -e '.[demo,peers]'
	$(PEERS_PY) -m pip install -q -c $(PEERS_PINS) --no-deps mosaicml-streaming litdata
	touch $@

venv-peers: $(PEERS_STAMP)

demo: $(STAMP)
	$(VENV)/bin/cached demo

lint: $(STAMP)
	$(VENV)/bin/ruff check cached cached_demo client tests bench deploy
	$(VENV)/bin/ruff format --check cached cached_demo client tests bench deploy

types: $(STAMP)
	$(VENV)/bin/mypy

# The S3-facing tests (marked `stores`) run on moto and on Ceph's RGW where system-deps could
# install it (tests/rgw.py), on moto alone otherwise; CACHED_TEST_STORE=moto|rgw|both chooses.
unit: $(STAMP) system-deps
	$(PY) -m pytest -q

# The S3-facing tests against RGW alone; fails, saying why, where RGW cannot start.
test-rgw: $(STAMP) system-deps
	CACHED_TEST_STORE=rgw $(PY) -m pytest -q -m stores

# `check` is what `test` runs: format, lint, types, the deployment files' static checks, the
# test suite, and the benchmark smoke runs.
check: lint types deploy-lint unit bench-small

test: check

bench: $(STAMP)
	$(PY) bench/serve.py
	$(PY) bench/epochs.py
	$(PY) bench/cache_sim.py
	$(PY) bench/volume.py
	$(PY) bench/seed.py --repeats 3 --torch-threads 1
	$(PY) bench/bounds_rss.py
	$(PY) bench/fetch.py
	$(PY) bench/fetch.py --sizes 16 4 --concurrency 4 --rate 400 --clients cached-native cached awscrt awscrt-indexed
	$(PY) bench/plan_wire.py
	$(PY) bench/budget.py
	$(PY) bench/budget.py --nodes 8 --shards-per-node 16 --shard-kb 1024 --store-mbps 40
	$(PY) bench/cluster_sim.py
	$(PY) bench/cluster_egress.py
	$(PEERS_PY) bench/shuffle_quality.py

bench-small: $(STAMP) $(PEERS_STAMP)
	$(PY) bench/serve.py --small
	$(PY) bench/epochs.py --small
	$(PY) bench/cache_sim.py --small
	$(PY) bench/fetch.py --small
	$(PY) bench/fetch.py --small --rate 200
	$(PY) bench/plan_wire.py --small
	$(PY) bench/budget.py --small
	$(PY) bench/budget.py --small --store-mbps 10 --shard-kb 256
	$(PY) bench/cluster_sim.py --small
	$(PY) bench/cluster_egress.py --small
	$(PY) bench/volume.py --shards 8 --samples 160 --epochs 2 --repeats 1
	$(PY) bench/seed.py --small
	$(PEERS_PY) bench/peers.py --small
	$(PEERS_PY) bench/shuffle_quality.py --small

# The peers side by side (docs/benchmarks.md, "Peers side by side"): webdataset, Mosaic
# Streaming, litdata, s3torchconnector and cached on one shaped S3 link, at 40 and 400 MB/s,
# the dataset fitting the cache and twice it; rewrites docs/peers.png. About 20 minutes here.
bench-peers: $(PEERS_STAMP)
	$(PEERS_PY) bench/peers.py --chart docs/peers.png

bench-peers-small: $(PEERS_STAMP)
	$(PEERS_PY) bench/peers.py --small

# The soak: 32 client streams (CachedDataset with workers, FastLoader) at full speed for 10
# minutes against one daemon, with a dataset twice the hot tier; memory, fds, loop stalls,
# errors, exactly-once (docs/benchmarks.md, "Soak"); then again beside a client that never
# reads its replies and one that sends oversized requests. It reports figures; `make test`
# runs it for 2 x 60 s as tests/test_soak.py, which judges them.
soak: $(STAMP)
	$(PY) bench/soak.py --compare

# On a GPU node (with a CUDA build of torch): byte-exact batches on the GPU under a slow
# consumer, and host-to-device bandwidth; under 3 minutes. Without CUDA it runs the CPU parts,
# prints "no CUDA: GPU parts skipped" and exits 0 (a skip, not a pass).
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

# Debian packages the deployment checks and the tests use (docker-compose, debootstrap,
# systemd-container, Ceph's RGW), installed when missing and this is root; otherwise each
# check says in one line what it skips.
system-deps:
	deploy/check/system-deps.sh

# The deployment files, checked without running them: hadolint on the Dockerfiles,
# `docker-compose config` on the compose file, every Kubernetes manifest against the
# Kubernetes schemas in strict mode.
deploy-lint: $(STAMP) system-deps
	$(VENV)/bin/hadolint Dockerfile deploy/compose/trainer.Dockerfile deploy/compose/moto.Dockerfile deploy/compose/rgw.Dockerfile
	deploy/check/compose-config.sh
	deploy/check/prometheus.sh
	$(PY) deploy/check/k8s.py

# The systemd unit as shipped, run under a real systemd (systemd-nspawn -b of a Debian
# root): readiness, socket permissions, group access, warm restart after SIGKILL, clean stop.
# Needs root and systemd-nspawn; elsewhere it says so in one line and skips.
deploy-check: $(STAMP) system-deps
	deploy/check/systemd.sh

# The docker-compose stack run for real (deploy/check/compose.sh): Debian's docker engine, every
# image built on a debootstrap root imported as the base, Ceph's RGW in MinIO's place; checks
# that dataset-init and the trainer exit 0 and, on the daemon's /metrics, that it served every
# sample as local reads. Needs root, dockerd and docker-compose; elsewhere one line, and skips.
compose-check: $(STAMP) system-deps
	deploy/check/compose.sh

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache .mypy_cache .ruff_cache .demo
