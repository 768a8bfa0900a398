# The two commands of the README:  make train  |  make test
# Both set everything up first (scripts/setup.sh: idempotent, seconds the second time).
VENV ?= $(CURDIR)/.venv
NP ?= 2
export VENV

.PHONY: setup train test

setup:
	bash scripts/setup.sh

# The main job: the digits CNN on $(NP) workers; fails unless it reaches 95% validation accuracy.
train: setup
	PATH="$(VENV)/bin:$$PATH" timeout -k 10 900 horovodrun -np $(NP) python train.py --require-accuracy 0.95

test: setup
	NP=$(NP) bash scripts/run_tests.sh
