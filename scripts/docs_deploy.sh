#!/usr/bin/env bash
# One version of the documentation onto the local gh-pages branch, with mike: built strictly, kept
# beside the earlier versions, aliased "latest", which is also the default the site's root opens.
# Nothing is pushed: `git push origin gh-pages` publishes it. Usage: DOCS_VENV=... docs_deploy.sh X.Y
set -euo pipefail
version=${1:-}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_bin=${DOCS_VENV:-$root/.venv-docs}/bin
mike=$venv_bin/mike
# mike runs the mkdocs it finds on PATH: the docs environment's.
export PATH=$venv_bin:$PATH
# A version is the release it documents, as the selector shows it: MAJOR.MINOR (a patch release
# replaces its minor's pages) or "dev" for main.
if ! [[ $version =~ ^([0-9]+\.[0-9]+|dev)$ ]]; then
  echo "docs-deploy: VERSION must be MAJOR.MINOR (e.g. 0.4) or dev, got '${version}'." >&2
  echo "Run: make docs-deploy VERSION=0.4" >&2
  exit 2
fi
cd "$root"
if ! git rev-parse --git-dir >/dev/null 2>&1; then
  echo "docs-deploy: $root is not a git clone; mike commits the site to its gh-pages branch." >&2
  exit 2
fi
export NO_MKDOCS_2_WARNING=1
if [ "$version" = dev ]; then
  "$mike" deploy dev
else
  "$mike" deploy --update-aliases "$version" latest
  # The site's root redirects to "latest": set once (mike commits it), then it follows the alias.
  git cat-file -e gh-pages:index.html 2>/dev/null || "$mike" set-default latest
fi
echo "docs-deploy: gh-pages now holds: $("$mike" list | tr '\n' ' ')"
echo "docs-deploy: look with '$mike serve'; publish with 'git push origin gh-pages'"
