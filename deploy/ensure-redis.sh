#!/bin/sh
# Install redis-server if missing. Tests and benchmarks start their own on a free port
# (loadtest/private_redis.py); nothing here starts or touches a Redis on 6379.
set -e
command -v redis-server >/dev/null 2>&1 && exit 0
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
command -v redis-server >/dev/null 2>&1 || { echo "redis-server could not be installed" >&2; exit 1; }
