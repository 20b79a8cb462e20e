# Sourced by .ci/run: the pinned Collector and Jaeger built in the background while the venvs
# install (deploy/build.sh), then what the build came to, told truly.
#
# The status line ("ok SECONDS" / "failed SECONDS") goes to a file of its own and build.sh's
# stderr to another: build.sh says "building otelcol -> PATH ..." on stderr, and a status
# read from a file that holds both once took that line for the status ("failed after
# otelcol -> /root/.cache/... s" after a build that worked).

go_build_start() {   # in the background; sets go_pid
  go_status_file=$(mktemp)
  go_err_file=$(mktemp)
  ( t0=$SECONDS
    if bash deploy/build.sh all >/dev/null 2>"$go_err_file"; then s=ok; else s=failed; fi
    echo "$s $((SECONDS - t0))" > "$go_status_file" ) &
  go_pid=$!
}

go_build_report() {  # waits for it; sets go_phase, and prints a warning naming the error when it failed
  local status="" secs="?"
  wait "$go_pid" || true
  read -r status secs < "$go_status_file" || true
  if [ "$status" = ok ]; then
    if grep -q '^building ' "$go_err_file"; then
      go_phase="go-build built in ${secs}s"
    else
      go_phase="go-build cached"
    fi
  else
    echo "warning: deploy/build.sh failed after ${secs:-?} s: $(tail -n 1 "$go_err_file")"
    go_phase="go-build failed after ${secs:-?}s"
  fi
  rm -f "$go_status_file" "$go_err_file"
}
