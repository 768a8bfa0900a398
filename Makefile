# The two commands of the README:  make train  |  make test   (and make docs: the documentation site,
# make docs-deploy VERSION=x.y: a version of it on the local gh-pages branch)
# Both set everything up first (scripts/setup.sh: idempotent, seconds the second time).
VENV ?= $(CURDIR)/.venv
NP ?= 2
export VENV

.PHONY: setup train test docs docs-env docs-deploy

setup:
	bash scripts/setup.sh

# The main job: the digits CNN on $(NP) workers; fails unless it reaches 95% validation accuracy.
train: setup
	PATH="$(VENV)/bin:$$PATH" timeout -k 10 900 horovodrun -np $(NP) python train.py --require-accuracy 0.95

test: setup
	NP=$(NP) bash scripts/run_tests.sh

# The documentation has its own light environment (mkdocs and its plugins, pinned in
# docs/requirements.txt; seconds to create): the site builds without the Horovod build, the API
# reference read statically from the source. The docs' runnable examples and the configuration
# reference's check need hvdtrain: they run in make test (tests/unit).
DOCS_VENV ?= $(CURDIR)/.venv-docs
PYTHON ?= python3

docs-env: $(DOCS_VENV)/.installed

$(DOCS_VENV)/.installed: docs/requirements.txt
	bash scripts/docs_env.sh "$(DOCS_VENV)" "$(PYTHON)"

# The site into site/ (ignored): strict, so a broken link or a missing API reference fails.
docs: docs-env
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet --site-dir site

# This version of the site onto the local gh-pages branch (mike), as VERSION and as "latest"; never pushed.
docs-deploy: docs-env
	DOCS_VENV="$(DOCS_VENV)" bash scripts/docs_deploy.sh "$(VERSION)"
