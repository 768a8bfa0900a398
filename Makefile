# The two commands of the README:  make train  |  make test   (and make docs: the documentation site)
# Both set everything up first (scripts/setup.sh: idempotent, seconds the second time).
VENV ?= $(CURDIR)/.venv
NP ?= 2
export VENV

.PHONY: setup train test docs

setup:
	bash scripts/setup.sh

# The main job: the digits CNN on $(NP) workers; fails unless it reaches 95% validation accuracy.
train: setup
	PATH="$(VENV)/bin:$$PATH" timeout -k 10 900 horovodrun -np $(NP) python train.py --require-accuracy 0.95

test: setup
	NP=$(NP) bash scripts/run_tests.sh

# The documentation site into site/ (ignored): strict, so a broken link or a missing API reference
# fails; then the docs' runnable examples (<!-- run --> blocks) and the generated reference's check.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_docs_examples.py tests/unit/test_config_reference.py
