# ScaleLab front door. Every target installs what it needs first; a second run does nothing slow.
#   make lab     JupyterLab on http://127.0.0.1:8888 opened on the student's view of the course (student/)
#   make test    the whole test suite
#   make hub     a class on one server: JupyterHub on http://127.0.0.1:8000, one JupyterLab per student (as root;
#                HUB_IP/HUB_PORT to change; containers/hub/hub.sh says what it installs and where)
#   make setup   Debian packages + .venv with the pinned stack + Horovod built with TensorFlow, Gloo and MPI
#                (PYTHON=/path/to/python3.11 picks the interpreter; on Python 3.12 or 3.13 the PyTorch edition
#                alone; see containers/setup.sh)
#   make doctor  what is installed and which data sets are available
#   make release / make autograde   the nbgrader cycle for the labs (see README)
#   make bench   the benchmark report
#   make image-cpu  the CPU image scalelab:cpu from containers/Dockerfile.cpu, with Docker or else podman
#                (IMAGE_BASE=localhost/NAME builds on a local base; containers/build-image.sh says more)

SHELL := /bin/bash
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
# `make setup PYTHON=/path/to/python3.11` (or PYTHON in the environment) reaches containers/setup.sh, which makes
# the venv from that interpreter; make passes command-line and environment variables on to the recipes itself.
SETUP_STAMP := $(VENV)/.scalelab-setup-done
# Configuration: where CIFAR-10 (official python format) lives when it is staged offline. The default is the
# shared real subset next to the checkout, if there is one; override with `make test SCALELAB_CIFAR10_DIR=...`.
SCALELAB_CIFAR10_DIR ?= $(abspath $(wildcard ../shared/data/cifar10-subset))
export SCALELAB_CIFAR10_DIR
LAB_PORT ?= 8888
# Whom `make lab` serves. student (the default): one student on their own machine, in student/ — the released labs,
# the assessment and START.md, never a solution or a hidden test. instructor: the whole repository, for preparing
# the course. (A class on one server is `make hub`.)
LAB_VIEW ?= student
STUDENT_DIR ?= student
ifeq ($(LAB_VIEW),student)
LAB_ROOT := $(abspath $(STUDENT_DIR))
LAB_START := START.md
LAB_SETUP_ARGS := --student-view $(LAB_ROOT)
else ifeq ($(LAB_VIEW),instructor)
LAB_ROOT := $(CURDIR)
LAB_START := README.md
LAB_SETUP_ARGS :=
else
$(error LAB_VIEW is student or instructor, not "$(LAB_VIEW)")
endif
# Assess service settings as traitlets, e.g. ASSESS_OPTIONS="--AssessService.track=fashion-mnist-cpu --AssessService.slots=1"
ASSESS_OPTIONS ?=
# mpirun refuses to start as root unless told; containers and CI run as root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export TF_CPP_MIN_LOG_LEVEL ?= 2
# Open MPI spins on a core while it waits unless it sees more processes than cores; Horovod's background
# thread waits like that every cycle, taking a core from TensorFlow on a CPU-only machine. Sleep instead.
export OMPI_MCA_mpi_yield_when_idle ?= 1
# Large allreduces under --mpi use the segmented ring (source_code/scalelab/openmpi-collective-rules.conf says why).
export OMPI_MCA_coll_tuned_use_dynamic_rules ?= 1
export OMPI_MCA_coll_tuned_dynamic_rules_filename ?= $(CURDIR)/source_code/scalelab/openmpi-collective-rules.conf
# The slowest tests are listed at the end, so that what CI's time goes to is on record, and every skipped test with
# its reason (the PyTorch edition skips the Keras tests).
PYTEST_ARGS ?= --durations=30 -rs

.PHONY: setup lab test hub doctor release autograde bench image-cpu clean

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml containers/setup.sh
	containers/setup.sh --venv $(VENV)
	touch $@

doctor: setup
	$(VENV)/bin/scalelab doctor

# First the course's kernel (the venv's bin/ first on PATH, the Open MPI settings above; the notebooks name it),
# JupyterLab's settings (Markdown rendered, no news pop-up) and the student's view (source_code/scalelab/lab_setup.py).
# JupyterLab starts in the folder it serves: nbgrader's extensions take that folder for the course directory.
lab: setup
	$(VENV)/bin/scalelab lab-setup $(LAB_SETUP_ARGS)
	cd $(LAB_ROOT) && $(abspath $(VENV))/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.root_dir=$(LAB_ROOT) --LabApp.default_url=/lab/tree/$(LAB_START) \
		--MappingKernelManager.default_kernel_name=scalelab \
		--ServerApp.jpserver_extensions=scalelab.grader.serve=True $(ASSESS_OPTIONS) \
		$$( [ "$$(id -u)" = 0 ] && echo --allow-root )

test: setup
	$(VENV)/bin/scalelab lab-setup
	[ "$$(id -u)" != 0 ] || containers/hub/hub.sh --install-only  # what tests/test_hub.py's `make hub` needs
	$(VENV_PYTHON) -m pytest $(PYTEST_ARGS)

# Its own venv (HUB_VENV, default /opt/scalelab/venv: every account runs it), not .venv; accounts with
# `scalelab class add-student NAME` from that venv.
HUB_IP ?= 127.0.0.1
HUB_PORT ?= 8000
hub:
	HUB_IP=$(HUB_IP) HUB_PORT=$(HUB_PORT) containers/hub/hub.sh

# The nbgrader course directory (holds nbgrader_config.py); point it at a copy to try the cycle elsewhere.
LABS ?= labs
# nbgrader runs `alembic` from PATH when it creates the gradebook, so the venv's bin/ goes first.
NBGRADER := PATH="$(abspath $(VENV))/bin:$$PATH" $(abspath $(VENV))/bin/nbgrader
# e.g. AUTOGRADE_OPTIONS=--force to grade again what is already graded
AUTOGRADE_OPTIONS ?=

# Student versions of every assignment in $(LABS)/source/, written to $(LABS)/release/ (no solutions, no hidden tests).
release: setup
	cd $(LABS) && for assignment in $$(cd source && ls -d */ | tr -d /); do \
		$(NBGRADER) generate_assignment "$$assignment" --force || exit 1; \
	done

# Grade every assignment with submissions in $(LABS)/submitted/<student>/<assignment>/ into $(LABS)/gradebook.db.
# The notebooks name the course's kernel: installed first, as for `make lab`.
autograde: setup
	$(VENV)/bin/scalelab lab-setup
	cd $(LABS) && assignments=$$(ls -d submitted/*/*/ 2>/dev/null | cut -d/ -f3 | sort -u); \
	[ -n "$$assignments" ] || { echo "nothing to grade: no $(LABS)/submitted/<student>/<assignment>/"; exit 0; }; \
	for assignment in $$assignments; do \
		$(NBGRADER) autograde "$$assignment" $(AUTOGRADE_OPTIONS) || exit 1; \
	done

# The benchmark report (report.json, report.md, plots) in $(BENCH_OUT); BENCH_ARGS=--quick for a smoke run.
BENCH_OUT ?= bench-report
BENCH_ARGS ?=
# Its Assess stage opens the assessment in JupyterLab, which needs the course's kernel (installed first).
bench: setup
	$(VENV)/bin/scalelab lab-setup
	PYTHONPATH=source_code $(VENV_PYTHON) -m benchmarks.run --out $(BENCH_OUT) $(BENCH_ARGS)

# Docker when its daemon answers, else podman; IMAGE_ENGINE=docker|podman to choose. IMAGE_BASE=localhost/NAME builds on
# that local image (`podman build --from`), keeping the Dockerfile's FROM for everyone else; containers/debian-base.sh
# makes a Debian 12 one where no registry can be reached (the tests do).
IMAGE_BASE ?=
image-cpu:
	IMAGE_BASE=$(IMAGE_BASE) containers/build-image.sh cpu

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
