#!/bin/sh
# Fails when git tracks a binary file (wheels, shared objects, archives...):
# binaries belong in package registries or build outputs, never in history.
# Uses git's own binary detection: a numstat against the empty tree reports
# "-  -" for binary files (a NUL byte in the first 8000); archive and object
# extensions are caught even when their bytes happen to look like text.
# Outside a git checkout there is nothing to check.
cd "$(dirname "$0")/.." || exit 1
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || exit 0
empty_tree=$(git hash-object -t tree /dev/null) || exit 1
binaries=$( (git diff --cached --numstat --no-renames "$empty_tree" | awk -F '\t' '$1 == "-" { print $3 }'
  git ls-files -- '*.whl' '*.so' '*.so.*' '*.a' '*.o' '*.pyc' '*.zip' '*.tar' '*.gz' '*.tgz' '*.xz' '*.bz2' \
    '*.pt' '*.pth' '*.npy' '*.npz') | sort -u)
if [ -n "$binaries" ]; then
  echo "error: binary files are tracked by git (remove them with git rm --cached; *.whl is ignored):" >&2
  echo "$binaries" | sed 's/^/  /' >&2
  exit 1
fi
