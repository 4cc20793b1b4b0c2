#!/bin/sh
# Start a throwaway Redis on 127.0.0.1:6379 for the tests if none answers; install it if missing.
set -e
if command -v redis-cli >/dev/null 2>&1 && redis-cli -p 6379 ping >/dev/null 2>&1; then exit 0; fi
if ! command -v redis-server >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
redis-server --daemonize yes --port 6379 --save '' --appendonly no
for _ in 1 2 3 4 5 6 7 8 9 10; do redis-cli -p 6379 ping >/dev/null 2>&1 && exit 0; sleep 0.3; done
echo "redis did not start" >&2; exit 1
