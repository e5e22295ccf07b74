#!/bin/bash
# After `DETACH=1 bash benchmarks/gpu/device.sh` (one call): each later call runs
#   export OUT; bash benchmarks/gpu/poll.sh SECONDS
# which waits until the detached run is done or SECONDS passed (holding the machine meanwhile),
# prints the new lines of its output, and brings back what it has written so far: device.txt,
# every top-level file of /root/gpu-run, and the rest (the A/B's folder, logs) as rest.tar.gz
# (the device tool returns at most 8 files). A run cut short by the session still leaves the
# last poll's copy.
set -u
R=/root/gpu-run; O=${OUT:?}; S=${1:-540}; END=$(( $(date +%s) + S ))
[ -d "$R" ] || { echo "no detached run in $R"; exit 1; }
SEEN=$(cat /root/.poll-lines 2>/dev/null || echo 0)
while [ ! -e "$R/.done" ] && [ "$(date +%s)" -lt "$END" ]; do sleep 5; done
N=$(wc -l < "$R/device.txt"); tail -n +$(( SEEN + 1 )) "$R/device.txt" | cut -c1-300; echo "$N" > /root/.poll-lines
[ -e "$R/.done" ] && echo "== detached run done" || echo "== detached run still going"
cp "$R/device.txt" "$O/"
n=1; for f in "$R"/*; do
  [ -f "$f" ] || continue; b=$(basename "$f"); [ "$b" = device.txt ] && continue
  [ $n -lt 6 ] && cp "$f" "$O/" && n=$(( n + 1 ))
done
(cd "$R" && tar -czf "$O/rest.tar.gz" --exclude=device.txt . 2>/dev/null); ls -la "$O"
