#!/usr/bin/env bash
# Copies of other commits for an A/B in one device call (lent machines differ by up to 2.7x, so a comparison
# is only a result inside one call). Here: bash benchmarks/ab_prepare.sh SHA [SHA...] writes ab/<sha>/ (the
# commit's engine/ and benchmarks/ without results; ab/ is git-ignored), then the device call carries "ab"
# and runs e.g. `bash benchmarks/gpu_suite.sh wrangle-ab`: the same workload from this tree and from every
# ab/<sha>/, one run id for all (commits before 8e4aff9 ignore LLMOPS_RUN_ID and draw their own). Remove ab/
# afterwards (rm -rf ab).
# AB_DIR: another folder than ab/ (the tests use one).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${AB_DIR:-ab}
for sha in "$@"; do
  full=$(git rev-parse --short "$sha^{commit}")
  rm -rf "${dir:?}/$full" && mkdir -p "$dir/$full"
  git archive "$full" engine benchmarks | tar -x -C "$dir/$full"
  rm -rf "$dir/$full/benchmarks/results"
  echo "$dir/$full"
done
