#!/usr/bin/env bash
# Runs the test suite in the environment made by scripts/setup.sh.
#   scripts/test.sh              # everything that can run here (gpu tests skip without CUDA)
#   scripts/test.sh --fast       # the same without tests marked slow
#   scripts/test.sh tests/core   # any pytest arguments: one plain pytest run
#
# With no pytest arguments the suite runs in two phases: the unit and integration tests spread
# over the machine's cores (pytest-xdist), then the end-to-end tests (marked e2e: servers and
# client processes), a file per worker, one worker more than the cores (PSYCHE_TEST_PHASES=together
# runs the two side by side). Both phases always run; the script reports each and fails if
# either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Every test process (each xdist worker, every server and client an end-to-end test starts)
# imports torch and transformers: from source that is about twice the CPU of an import from
# bytecode (~6 s more per process on two cores). Bytecode goes to one cache inside .venv, so it is
# written once and the checkout stays clean, even where PYTHONDONTWRITEBYTECODE is set to keep
# __pycache__ directories out of it (it is, on the machines this suite is tuned on).
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$PWD/.venv/pycache}"
unset PYTHONDONTWRITEBYTECODE
markers=()
args=()
for a in "$@"; do
    if [ "$a" = "--fast" ]; then markers+=("not slow"); else args+=("$a"); fi
done

join() { local IFS=' '; local out=""; for m in "$@"; do out="${out:+$out and }($m)"; done; echo "$out"; }

if [ ${#args[@]} -gt 0 ]; then
    selection=$(join "${markers[@]}")
    exec python -m pytest ${selection:+-m "$selection"} "${args[@]}"
fi

# pytest exits 5 when it collected nothing. With --fast every end-to-end test may be filtered
# out, so 5 passes there; anywhere else an empty phase is a failure.
outcome() {
    case "$1" in
        0) echo "passed" ;;
        5) if [ "$2" = "optional" ]; then echo "passed (nothing selected)"; else echo "FAILED (no tests collected)"; fi ;;
        *) echo "FAILED (pytest exit $1)" ;;
    esac
}

# The two phases run one after the other, the unit phase first; PSYCHE_TEST_PHASES=together
# runs them side by side. Both mostly wait: the unit phase's in-process runs and the end-to-end files'
# client processes ride on round timers, so one phase alone leaves much of two cores idle.
# tests/timing.py stretches every round timer to the machine's measured speed, so the busier
# machine costs the tests time, never their verdict. The end-to-end phase's output is kept in a
# file and printed, whole, after the unit phase's. Side by side, a fresh-clone `.ci/run` took
# 636-640 s on an idle two-core machine (one after the other: about 1,300 s), but three such runs
# each failed one test on a race the extra processes made likelier (a signal landing in a
# libp2p handler, a restarted endpoint's port taken by another process's connection: both
# fixed; a coordinator test whose 2 s warmup timer could end first: its warmup lengthened), so
# it is not the default until a few fresh-clone runs of it are clean.
#
# The unit phase runs a worker per core (at most 4). One more was tried (3 on two cores: its
# waits on round timers would overlap the CPU-bound tests): tests/client alone went 0.91x at a
# higher load, but the whole unit phase of a fresh-clone CI run took 523 s (another run beside it
# for its first minutes) against 380 s with two on a quiet machine,
# its in-process runs 1.3-1.7x longer (a crowded round timer), so two it stays.
# PSYCHE_TEST_WORKERS and PSYCHE_TEST_E2E_WORKERS set the two phases' worker counts instead (to
# measure another split).
cores=$(python -c 'import os; print(max(1, len(os.sched_getaffinity(0))))')
workers=${PSYCHE_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
# End-to-end tests spend most of their time waiting on round timers, so several run side by side
# (whole files per worker: the tests of one file share their run), a worker more than the cores.
# Two CI runs of this suite side by side on two cores (four e2e workers at once for most of their
# e2e phases) were green, each file taking about as long as in a run alone under load;
# one file alone on the shared two-core machine used 0.25-0.45 of a core over its wall time
# (test_training, test_hostile_members). Where a third file crowds the rounds, their timers are
# stretched to the machine's measured speed (tests/timing.py). The files go out longest first
# (tests/conftest.py's `E2E_SECONDS`), not in xdist's order.
# At most 4, as the unit phase: each file runs a server and several torch clients.
e2e_workers=${PSYCHE_TEST_E2E_WORKERS:-$(( cores < 4 ? cores + 1 : 4 ))}
unit_phase() { python -m pytest -n "$workers" -m "$(join "${markers[@]}" "not e2e")"; }
e2e_phase() {
    python -m pytest -n "$e2e_workers" --dist loadfile --no-loadscope-reorder \
        -m "$(join "${markers[@]}" "e2e")"
}
if [ "${PSYCHE_TEST_PHASES:-apart}" = apart ]; then
    unit_phase
    unit=$?
    e2e_phase
    e2e=$?
else
    e2e_log=$(mktemp "${TMPDIR:-/tmp}/psyche-e2e.XXXXXX")
    # A signal ends both phases (the end-to-end one is a background job of this shell).
    trap 'kill -- -"$e2e_pid" 2>/dev/null || kill "$e2e_pid" 2>/dev/null; rm -f "$e2e_log"; exit 130' INT TERM
    set -m  # the background phase gets its own process group, so the trap can end all of it
    e2e_phase > "$e2e_log" 2>&1 &
    e2e_pid=$!
    set +m
    echo "test.sh: the end-to-end tests run beside the unit tests; their output follows them"
    unit_phase
    unit=$?
    if kill -0 "$e2e_pid" 2>/dev/null; then
        echo "test.sh: waiting for the end-to-end tests to finish"
    fi
    wait "$e2e_pid"
    e2e=$?
    echo "test.sh: ---- end-to-end tests ----"
    cat "$e2e_log"
    rm -f "$e2e_log"
    trap - INT TERM
fi

e2e_kind=required
if [ ${#markers[@]} -gt 0 ]; then e2e_kind=optional; fi
unit_text=$(outcome "$unit" required)
e2e_text=$(outcome "$e2e" "$e2e_kind")
echo "test.sh: unit and integration tests: $unit_text"
echo "test.sh: end-to-end tests: $e2e_text"
case "$unit_text $e2e_text" in
    *FAILED*) exit 1 ;;
esac
exit 0
