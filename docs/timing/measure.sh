#!/usr/bin/env bash
# Times one README command on this machine and writes its log here: the commit, `uptime` before and after (the
# load), everything the command prints, and its wall time (`/usr/bin/time`).
#
#   bash docs/timing/measure.sh LOG_NAME BUSY_LOOPS COMMAND...
#
# BUSY_LOOPS shells running `while :; do :; done` share the cores with the command (0: the machine as it is),
# as another user's programs would. docs/generate.py reads the logs into the README's table of times.
set -uo pipefail
cd "$(dirname "$0")/../.."
name=$1 busy=$2
shift 2
log=docs/timing/$name.log
# Written beside and moved into place at the end: a command that reads the logs (the test suite's check of the
# README's table) sees the last complete one while this one is written.
partial=$(mktemp "docs/timing/.$name.XXXXXX")
loops=()
for _ in $(seq 1 "$busy"); do
  bash -c 'while :; do :; done' &
  loops+=($!)
done
trap '[ ${#loops[@]} -gt 0 ] && kill "${loops[@]}" 2>/dev/null' EXIT
[ "$busy" -gt 0 ] && sleep 20  # the load average climbs to the loops before the command starts
{
  echo "# commit $(git rev-parse --short HEAD), busy loops $busy: $*"
  echo "# $(uptime)  (uptime before)"
} > "$partial"
/usr/bin/time -f "WALL %e s" bash -c "$*" >> "$partial" 2>&1
status=$?
echo "# $(uptime)  (uptime after)" >> "$partial"
echo "# exit $status" >> "$partial"
mv "$partial" "$log"
tail -n 4 "$log"
exit $status
