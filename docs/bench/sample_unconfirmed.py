# Usage: python3 sample_unconfirmed.py > samples.txt & (run on the broker's host, as a user
# allowed to run rabbitmqctl), then start a drain, e.g.
# outbox-bench --only drain --events 100000 --keys 1000; stop it with kill <its pid>.
# Samples, about every second, the unconfirmed messages on channels of connections named
# outbox-relay@* (the relay under test), until killed.
import subprocess, time, sys
def q(args):
    return subprocess.run(["rabbitmqctl"] + args + ["-q", "--no-table-headers"], capture_output=True, text=True).stdout
while True:
    conns = {}
    for l in q(["list_connections", "pid", "client_properties"]).splitlines():
        if "outbox-relay@" in l:
            conns[l.split()[0]] = True
    tot = 0; n = 0
    for l in q(["list_channels", "connection", "messages_unconfirmed"]).splitlines():
        parts = l.split()
        if len(parts) >= 2 and parts[0] in conns:
            tot += int(parts[-1]); n += 1
    if n:
        print(time.strftime("%T"), "channels", n, "unconfirmed", tot, flush=True)
    time.sleep(0.3)
