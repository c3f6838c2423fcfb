#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this machine, for trying the relay against a cluster and
# for the cluster test (tests/it/cluster.rs); with one node named, a private single node (the
# soak's own broker, which it restarts). Each node has its own node name, AMQP port, Erlang
# distribution port and data directory; each loads the plugins CLUSTER_PLUGINS names (none
# by default), never the management plugin (its port would clash with the node already
# running on 5672/15672).
#
#   deploy/cluster/rabbitmq-cluster.sh start          # start the three nodes and cluster them
#   deploy/cluster/rabbitmq-cluster.sh status         # nodes, ports, cluster and quorum queues
#   deploy/cluster/rabbitmq-cluster.sh urls           # the relay's --amqp-url for the cluster
#   deploy/cluster/rabbitmq-cluster.sh leader QUEUE   # the node that leads a quorum queue
#   deploy/cluster/rabbitmq-cluster.sh stop-node NODE # stop one node (NODE: a, b, c or its name)
#   deploy/cluster/rabbitmq-cluster.sh start-node NODE
#   deploy/cluster/rabbitmq-cluster.sh stop [--purge] # stop every node (--purge: delete the data)
#
# Settings (environment): CLUSTER_DIR (default ${TMPDIR:-/tmp}/outbox-rabbitmq-cluster),
# CLUSTER_NODES (default "rabbit-a rabbit-b rabbit-c", all @localhost; one to three names),
# CLUSTER_PORTS (default "5681 5682 5683"), CLUSTER_DIST_PORTS (default "25681 25682 25683"),
# as many ports as nodes; CLUSTER_PLUGINS (plugin names separated by spaces; default: none).
#
# Needs rabbitmq-server installed (Debian: apt-get install rabbitmq-server). Run as root
# (the nodes then run as the rabbitmq user and share its Erlang cookie with rabbitmqctl),
# as the rabbitmq user, or as any user that has the scripts in RABBITMQ_SBIN on its own.
set -euo pipefail

DIR=${CLUSTER_DIR:-${TMPDIR:-/tmp}/outbox-rabbitmq-cluster}
read -r -a NODES <<<"${CLUSTER_NODES:-rabbit-a rabbit-b rabbit-c}"
read -r -a PORTS <<<"${CLUSTER_PORTS:-5681 5682 5683}"
read -r -a DIST <<<"${CLUSTER_DIST_PORTS:-25681 25682 25683}"
SBIN=${RABBITMQ_SBIN:-/usr/lib/rabbitmq/bin}
HOST=localhost

log() { echo "rabbitmq-cluster: $*" >&2; }
die() { log "$*"; exit 1; }

read -r -a PLUGINS <<<"${CLUSTER_PLUGINS-}"
N=${#NODES[@]}
[ "$N" -ge 1 ] && [ "$N" -le 3 ] && [ "${#PORTS[@]}" = "$N" ] && [ "${#DIST[@]}" = "$N" ] ||
  die "CLUSTER_NODES (one to three names), CLUSTER_PORTS and CLUSTER_DIST_PORTS must name as many each"
INDEXES=$(seq 0 $((N - 1)))
[ -x "$SBIN/rabbitmq-server" ] ||
  die "no $SBIN/rabbitmq-server: install rabbitmq-server (apt-get install rabbitmq-server) or set RABBITMQ_SBIN"

broker_user() {
  if [ "$(id -u)" = 0 ] && id rabbitmq >/dev/null 2>&1; then echo rabbitmq; else id -un; fi
}

# Runs a RabbitMQ script as the broker user (root switches to rabbitmq, whose HOME holds
# the Erlang cookie every node and rabbitmqctl must share). Arguments are quoted for su.
as_broker() {
  local quoted
  quoted=$(printf '%q ' "$@")
  if [ "$(broker_user)" != "$(id -un)" ]; then
    su "$(broker_user)" -s /bin/sh -c "cd / && HOME=/var/lib/rabbitmq $quoted"
  else
    sh -c "cd / && $quoted"
  fi
}

node_name() { echo "${NODES[$1]}@$HOST"; }

# a|b|c, 0|1|2, the short name or the full name → index
index_of() {
  local i
  case $1 in
    a | 0) i=0 ;;
    b | 1) i=1 ;;
    c | 2) i=2 ;;
  esac
  if [ -n "${i:-}" ] && [ "$i" -lt "$N" ]; then echo "$i"; return; fi
  for i in $INDEXES; do
    if [ "$1" = "${NODES[$i]}" ] || [ "$1" = "$(node_name "$i")" ]; then echo "$i"; return; fi
  done
  die "no node '$1' (use a, b, c or a node name)"
}

ctl() { # ctl INDEX args...
  local i=$1
  shift
  as_broker "$SBIN/rabbitmqctl" -n "$(node_name "$i")" "$@"
}

running() { ctl "$1" -q ping >/dev/null 2>&1; }

start_node() {
  local i=$1 name dir
  name=$(node_name "$i")
  dir="$DIR/${NODES[$i]}"
  if running "$i"; then
    log "$name already running"
    return 0
  fi
  mkdir -p "$dir/mnesia" "$dir/log"
  # An Erlang list: [] or [p1,p2].
  (IFS=,; echo "[${PLUGINS[*]}].") >"$dir/enabled_plugins"
  # The node's own listener: the system's /etc/rabbitmq/rabbitmq.conf may name 5672.
  printf 'listeners.tcp.local = 127.0.0.1:%s\n' "${PORTS[$i]}" >"$dir/rabbitmq.conf"
  if [ "$(broker_user)" != "$(id -un)" ]; then chown -R "$(broker_user)" "$DIR"; fi
  log "starting $name (amqp 127.0.0.1:${PORTS[$i]}, distribution ${DIST[$i]}, data $dir)"
  as_broker env \
    RABBITMQ_NODENAME="$name" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="${PORTS[$i]}" \
    RABBITMQ_DIST_PORT="${DIST[$i]}" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" \
    RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_PID_FILE="$dir/node.pid" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
    RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
    "$SBIN/rabbitmq-server" -detached
}

await_node() {
  # await_startup fails at once while a fresh -detached node is not yet known to epmd.
  local n
  for n in $(seq 1 60); do
    if ctl "$1" -q await_startup --timeout 120 >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  die "$(node_name "$1") did not start; see $DIR/${NODES[$1]}/log"
}

stop_node() {
  local i=$1
  if ! running "$i"; then
    log "$(node_name "$i") not running"
    return 0
  fi
  log "stopping $(node_name "$i")"
  # With the pid file, stop returns once the node's OS process is gone.
  ctl "$i" -q stop "$DIR/${NODES[$i]}/node.pid" >/dev/null
}

clustered() { # is node INDEX a member of the first node's cluster?
  ctl 0 -q cluster_status 2>/dev/null | grep -q "$(node_name "$1")"
}

cmd_start() {
  mkdir -p "$DIR"
  local i
  for i in $INDEXES; do start_node "$i"; done
  for i in $INDEXES; do await_node "$i"; done
  for i in $(seq 1 $((N - 1))); do
    if clustered "$i"; then continue; fi
    log "joining $(node_name "$i") to $(node_name 0)"
    # Joining logs feature-flag chatter on stderr; keep it with the node's logs.
    {
      ctl "$i" -q stop_app &&
        ctl "$i" -q reset &&
        ctl "$i" -q join_cluster "$(node_name 0)" &&
        ctl "$i" -q start_app
    } >>"$DIR/join.log" 2>&1 || die "joining $(node_name "$i") failed; see $DIR/join.log"
    await_node "$i"
  done
  log "cluster up: $(cmd_urls)"
}

cmd_stop() {
  local i
  for i in $(seq $((N - 1)) -1 0); do stop_node "$i"; done
  if [ "${1:-}" = --purge ]; then
    rm -rf "$DIR"
    log "removed $DIR"
  fi
}

cmd_urls() {
  local i urls=""
  for i in $INDEXES; do
    urls="$urls${urls:+,}amqp://guest:guest@127.0.0.1:${PORTS[$i]}/%2f"
  done
  echo "$urls"
}

first_running() {
  local i
  for i in $INDEXES; do
    if running "$i"; then echo "$i"; return 0; fi
  done
  die "no node of the cluster is running"
}

cmd_leader() {
  local q=${1:?usage: leader QUEUE}
  ctl "$(first_running)" -q list_queues --no-table-headers name leader |
    awk -v q="$q" '$1 == q { print $2 }'
}

cmd_status() {
  local i state
  for i in $INDEXES; do
    if running "$i"; then state=running; else state=stopped; fi
    echo "$(node_name "$i")  amqp 127.0.0.1:${PORTS[$i]}  dist ${DIST[$i]}  $state"
  done
  i=$(first_running) || return 0
  echo "Running nodes (as $(node_name "$i") sees them):"
  ctl "$i" -q cluster_status | sed 's/\x1b\[[0-9;]*m//g' |
    awk '/^Running Nodes/ { f = 1; next } f && NF { print "  " $0; n = 1; next } f && n { exit }'
  echo "Quorum queues (name, leader, members):"
  ctl "$i" -q list_queues --no-table-headers name type leader members |
    awk '$2 == "quorum" { $2 = ""; print "  " $0 }'
}

case ${1:-} in
  start) cmd_start ;;
  stop) cmd_stop "${2:-}" ;;
  status) cmd_status ;;
  urls) cmd_urls ;;
  leader) cmd_leader "${2:-}" ;;
  stop-node) stop_node "$(index_of "${2:?usage: stop-node NODE}")" ;;
  start-node)
    i=$(index_of "${2:?usage: start-node NODE}")
    start_node "$i"
    await_node "$i"
    ;;
  *)
    sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
