#!/bin/sh
# Two `dmutex run` commands contend for one key on the default lock file: an
# SQLite file at $XDG_STATE_HOME/dmutex/locks.sqlite3, else
# ~/.local/state/dmutex/locks.sqlite3, made on first use. No server needed.
# Run it from a clone after `pip install -e .`, with dmutex on PATH.
set -u
key=quickstart

dmutex run "$key" -- sh -c 'echo "first:  holds $DMUTEX_KEY (fence $DMUTEX_FENCE) for 2 s"; sleep 2' &
first=$!

# `dmutex status` exits 0 while a permit of the key is held: wait for the first.
tries=0
until dmutex status "$key" >/dev/null; do
    tries=$((tries + 1))
    if [ "$tries" -gt 200 ]; then echo "the first command never took the lock"; exit 1; fi
    sleep 0.05
done

dmutex run -n "$key" -- echo "never printed: the lock is held"
echo "second: -n refused at once, exit status $?"

dmutex run "$key" -- sh -c 'echo "third:  waited for the first, then ran (fence $DMUTEX_FENCE)"'
wait "$first"
if dmutex status "$key" >/dev/null; then echo "lock still held"; exit 1; fi
echo "lock free again: OK"
