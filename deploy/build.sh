#!/usr/bin/env bash
# Build the pinned OpenTelemetry Collector (deploy/otelcol) and Jaeger v2 (deploy/jaeger)
# from their Go modules, once per version: the binaries are cached under
# ${DFLASH_BIN_DIR:-~/.cache/dflash/bin} with the release and a hash of the build inputs
# in their names, so a second call (or a second clone) costs nothing.
#
#   deploy/build.sh [otelcol|jaeger|all] [--print]    # --print: only print the paths
#
# Needs Go 1.26+ (the collector 0.165 modules ask for it) and the Go module proxy the
# first time. Prints one path per binary.
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
  esac
}

build_one() {
  local name="$1" out
  out="$(target_path "$name")"
  if [[ $print_only == 1 || -x "$out" ]]; then
    echo "$out"
    return
  fi
  command -v go >/dev/null || { echo "deploy/build.sh: go is not installed (needed once to build $name)" >&2; exit 3; }
  mkdir -p "$bin_dir"
  local t0=$SECONDS tmp="$out.tmp.$$"
  echo "building $name -> $out (first time only; several minutes on 2 cores)" >&2
  case "$name" in
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
  otelcol|jaeger) build_one "$what" ;;
  all) build_one otelcol; build_one jaeger ;;
  *) echo "usage: deploy/build.sh [otelcol|jaeger|all] [--print]" >&2; exit 2 ;;
esac
