#!/usr/bin/env bash
# Keep shipped weights off a device call: the tracked tree (two shipped drafters, ~67 MB) is over what a call
# carries (64 MiB) even before a GGUF part. `stash.sh out PATH…` untracks PATH here (git rm --cached) and
# ignores it (.git/info/exclude), so the call sends neither; the files stay on this disk. `stash.sh in` tracks
# everything stashed again. Never commit while something is stashed (git status shows it as deleted).
#   bash tools/remote_gpu/stash.sh out dflash_jax/assets/smollm2-135m-dspark   # before calls 1–3
#   bash tools/remote_gpu/stash.sh in                                          # after the session
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
LIST=.git/dflash-stashed
EXCLUDE=.git/info/exclude
case "${1:-}" in
  out)
    shift
    for path in "$@"; do
      git rm -r -q --cached -- "$path"
      echo "/$path" >> "$EXCLUDE"
      echo "$path" >> "$LIST"
    done ;;
  in)
    [ -f "$LIST" ] || exit 0
    while read -r path; do
      grep -vxF "/$path" "$EXCLUDE" > "$EXCLUDE.tmp" || true
      mv "$EXCLUDE.tmp" "$EXCLUDE"
      git add -- "$path"
    done < "$LIST"
    rm -f "$LIST" ;;
  *) echo "usage: $0 out PATH… | in" >&2; exit 2 ;;
esac
git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "tracked tree now %.1f MB\n", $1 / 1e6}'
