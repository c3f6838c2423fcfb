#!/usr/bin/env bash
# Makes sure local Postgres (127.0.0.1:5432, user postgres without a password) and
# RabbitMQ (127.0.0.1:5672, guest/guest) are running: starts them when installed but
# stopped, installs the Debian packages when missing (as root or with sudo), and otherwise
# says exactly what to install. Sourced by scripts/test and scripts/run.

set -euo pipefail

log() { echo "services: $*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  local port=$1 what=$2 limit=${3:-60}
  for _ in $(seq 1 $((limit * 5))); do
    port_open "$port" && return 0
    sleep 0.2
  done
  log "$what did not open 127.0.0.1:$port within ${limit}s"
  return 1
}

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else return 1
  fi
}

apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    return 1
  fi
  log "installing $* (Debian packages)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_postgres() {
  if port_open 5432; then return 0; fi
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
    apt_install postgresql || {
      log "PostgreSQL is not installed and cannot be installed here."
      log "install it (Debian/Ubuntu: apt-get install postgresql), start it on 127.0.0.1:5432,"
      log "and allow user postgres without a password from 127.0.0.1 (pg_hba.conf: host all postgres 127.0.0.1/32 trust),"
      log "or point the tests elsewhere with IT_DATABASE_URL=postgres://user:pass@host:port/postgres"
      exit 1
    }
    local version
    version=$(ls /etc/postgresql | sort -V | tail -1)
    # A fresh install asks for a password on TCP. The tests connect as `postgres` without
    # one, from 127.0.0.1 only: that one user is trusted there, every other role keeps
    # needing its password (the roles tests set theirs), so a local account cannot become
    # any role it likes. (Still a superuser without a password on loopback: throw-away
    # local services, never a shared machine's.)
    as_root sed -i -E '0,/^host\s+all\s+all\s+127\.0\.0\.1\/32/s//host    all             postgres        127.0.0.1\/32            trust\n&/' "/etc/postgresql/$version/main/pg_hba.conf"
  fi
  local version
  version=$(ls /etc/postgresql | sort -V | tail -1)
  log "starting PostgreSQL $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_port 5432 PostgreSQL 60
}

ensure_rabbitmq() {
  if port_open 5672; then return 0; fi
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    apt_install rabbitmq-server || {
      log "RabbitMQ is not installed and cannot be installed here."
      log "install it (Debian/Ubuntu: apt-get install rabbitmq-server) and start it on 127.0.0.1:5672"
      log "with the default guest/guest user, or point the tests elsewhere with IT_AMQP_URL"
      exit 1
    }
  fi
  if ! port_open 5672; then
    log "starting RabbitMQ"
    as_root rabbitmq-server -detached >/dev/null 2>&1 || true
    wait_port 5672 RabbitMQ 120
    as_root timeout 60 rabbitmqctl await_startup >/dev/null 2>&1 || true
  fi
}

# The dashboard test drives headless Chromium (tests/it/dashboard.rs). Debian's package;
# the test itself only looks for /usr/bin/chromium (or IT_CHROMIUM) and names the package
# when it is missing.
ensure_chromium() {
  if [ -n "${IT_CHROMIUM:-}" ] || [ -x /usr/bin/chromium ]; then return 0; fi
  apt_install chromium || {
    log "Chromium is not installed and cannot be installed here; the dashboard test needs it."
    log "install it (Debian/Ubuntu: apt-get install chromium) or name a binary with IT_CHROMIUM"
    exit 1
  }
}

ensure_services() {
  ensure_postgres
  ensure_rabbitmq
}

# Tools the test suite uses besides the services: psql (tests apply sql/roles.sql with it, as
# an operator does) and python3 with PyYAML (tests parse deploy/*.yaml with it). Installed
# when missing and possible; otherwise the tests that need them fail saying what is missing.
ensure_test_tools() {
  if ! command -v psql >/dev/null 2>&1; then
    apt_install postgresql-client || log "psql is missing: install postgresql-client"
  fi
  if ! command -v python3 >/dev/null 2>&1; then
    apt_install python3 python3-yaml || log "python3 is missing: install python3 and PyYAML"
  elif ! python3 -c 'import yaml' >/dev/null 2>&1; then
    log "installing PyYAML"
    python3 -m pip install --quiet pyyaml >/dev/null 2>&1 ||
      apt_install python3-yaml ||
      log "PyYAML is missing: pip install pyyaml"
  fi
  # The Python consumer-group member (examples/python) and its test: psycopg 3 and pika.
  if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import psycopg, pika' >/dev/null 2>&1; then
    log "installing psycopg and pika (Python)"
    python3 -m pip install --quiet 'psycopg[binary]' pika >/dev/null 2>&1 ||
      apt_install python3-psycopg python3-pika ||
      log "psycopg or pika is missing: pip install 'psycopg[binary]' pika"
  fi
}
