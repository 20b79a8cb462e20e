#!/usr/bin/env bash
# Build the pinned OpenTelemetry Collector (deploy/otelcol) and Jaeger v2 (deploy/jaeger)
# from their Go modules, once per version: the binaries are cached under
# ${DFLASH_BIN_DIR:-~/.cache/dflash/bin} with the release and a hash of the build inputs
# in their names, so a second call (or a second clone) costs nothing.
#
#   deploy/build.sh [otelcol|jaeger|jaeger-ui|all] [--print]    # --print: only print the paths
#
# Needs Go 1.26+ (the collector 0.165 modules ask for it) and the Go module proxy the
# first time. Prints one path per binary.
#
# jaeger-ui (not part of `all`: `make backend-bins` asks for it, CI does not): Jaeger's web
# UI, which a Go build does not embed (it serves a placeholder page). Built from the
# jaeger-ui release Jaeger ships (JAEGER_UI_VERSION) with node 20.19+ and npm, ~2 min on 2
# cores, into a directory (index.html, static/) that deploy/backends.py hands to Jaeger as
# JAEGER_UI_ASSETS. Sources: a git clone of $JAEGER_UI_REPO (default GitHub's; a local
# clone or bare mirror with the tag works too) and the npm registry.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=deploy/versions.env
. "$here/versions.env"
bin_dir="${DFLASH_BIN_DIR:-$HOME/.cache/dflash/bin}"
what="${1:-all}"
print_only=0
[[ "${2:-}" == "--print" || "${1:-}" == "--print" ]] && print_only=1
[[ "$what" == "--print" ]] && what=all

inputs_hash() {  # the build inputs: a change to go.mod or main.go makes a new binary name
  cat "$@" | sha256sum | cut -c1-10
}

target_path() {
  case "$1" in
    otelcol) echo "$bin_dir/dflash-otelcol-$OTELCOL_CONTRIB_VERSION-$(inputs_hash "$here/otelcol/go.mod" "$here/otelcol/go.sum" "$here/otelcol/main.go")" ;;
    jaeger)  echo "$bin_dir/jaeger-$JAEGER_VERSION-$(inputs_hash "$here/jaeger/go.mod" "$here/jaeger/go.sum")" ;;
    jaeger-ui) echo "$bin_dir/jaeger-ui-$JAEGER_UI_VERSION" ;;   # a directory
  esac
}

build_ui() {  # jaeger-ui's release tag -> $1 (index.html + static/), via a temporary checkout
  local out="$1" repo="${JAEGER_UI_REPO:-https://github.com/jaegertracing/jaeger-ui}" src
  src="$(mktemp -d)"
  trap "rm -rf '$src'" EXIT   # expanded now: \$src is local
  git -c advice.detachedHead=false clone -q --depth 1 --branch "v$JAEGER_UI_VERSION" "$repo" "$src"
  # npm workspaces: `npm ci` also builds the UI's own graph package (plexus). Its engines
  # field asks for node 24; the build (vite 7) runs on 20.19+, so that is only a warning.
  (cd "$src" && npm ci --engine-strict=false --no-audit --no-fund --loglevel=error >&2 \
     && cd packages/jaeger-ui && npm run build >&2)
  mv "$src/packages/jaeger-ui/build" "$out"
}

build_one() {
  local name="$1" out
  out="$(target_path "$name")"
  if [[ $print_only == 1 || -x "$out" ]]; then   # jaeger-ui: a directory, moved in once complete
    echo "$out"
    return
  fi
  mkdir -p "$bin_dir"
  local t0=$SECONDS tmp="$out.tmp.$$"
  if [[ $name == jaeger-ui ]]; then
    command -v node >/dev/null && command -v npm >/dev/null \
      || { echo "deploy/build.sh: node and npm are not installed (needed once to build jaeger-ui; node 20.19+)" >&2; exit 3; }
  else
    command -v go >/dev/null || { echo "deploy/build.sh: go is not installed (needed once to build $name)" >&2; exit 3; }
  fi
  echo "building $name -> $out (first time only; several minutes on 2 cores)" >&2
  case "$name" in
    jaeger-ui) build_ui "$tmp" ;;
    otelcol)
      (cd "$here/otelcol" && go build -buildvcs=false -trimpath -ldflags "-s -w -X main.version=$OTELCOL_CONTRIB_VERSION" -o "$tmp" .) ;;
    jaeger)   # the module's tool directive pins github.com/jaegertracing/jaeger@v$JAEGER_MODULE_VERSION
      (cd "$here/jaeger" && go build -buildvcs=false -trimpath -ldflags "-s -w -X github.com/jaegertracing/jaeger/internal/version.latestVersion=v$JAEGER_VERSION" -o "$tmp" github.com/jaegertracing/jaeger/cmd/jaeger) ;;
  esac
  mv -f "$tmp" "$out"
  echo "built $name in $((SECONDS - t0)) s" >&2
  echo "$out"
}

case "$what" in
  otelcol|jaeger|jaeger-ui) build_one "$what" ;;
  all) build_one otelcol; build_one jaeger ;;   # not jaeger-ui: CI calls `all` and needs no npm build
  *) echo "usage: deploy/build.sh [otelcol|jaeger|jaeger-ui|all] [--print]" >&2; exit 2 ;;
esac
