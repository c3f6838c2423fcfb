#!/usr/bin/env bash
# outbox-relay container probe: GET a path of the relay's HTTP endpoint without curl or wget
# (the runtime image has neither): exit 0 on HTTP 200, 1 otherwise, with the status on stderr.
#
#   outbox-relay-probe /readyz    # Postgres and RabbitMQ sessions up, not shutting down
#   outbox-relay-probe /livez     # the process answers
#
# The port comes from OUTBOX_HTTP_LISTEN (as the relay reads it; default 9464); the probe
# always connects to 127.0.0.1, so it works whether the relay binds 0.0.0.0 or 127.0.0.1.
set -u
path=${1:-/readyz}
listen=${OUTBOX_HTTP_LISTEN:-127.0.0.1:9464}
port=${listen##*:}
if ! { exec 3<>"/dev/tcp/127.0.0.1/${port}"; } 2>/dev/null; then
    echo "outbox-relay-probe: nothing listens on 127.0.0.1:${port}" >&2
    exit 1
fi
printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' "$path" >&3
if ! IFS= read -r -t 5 status <&3; then
    echo "outbox-relay-probe: no answer from 127.0.0.1:${port}${path}" >&2
    exit 1
fi
status=${status%$'\r'}
case $status in
    "HTTP/1."?" 200 "*) exit 0 ;;
    *)
        echo "outbox-relay-probe: ${path}: ${status}" >&2
        exit 1
        ;;
esac
