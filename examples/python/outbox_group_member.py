#!/usr/bin/env python3
"""A member of an ordered outbox consumer group, in Python, on the SQL functions.

The group's router (`outbox-relay group-router --queue Q --partitions P`) moves the group's
events from `Q.intake` to the partition queue of their key. Members like this one share the
partition queues and apply each key's events one after another in seq order:

- membership: a heartbeat in Postgres (`outbox_group_beat`, database clock) every third of the
  lease returns the live members sorted; member i of n owns the partitions p with p % n == i.
  A partition is consumed on a channel of its own; a lost partition's channel is closed (never
  basic.cancel): single-active-consumer on the partition queue lets the next owner in only
  once that channel is gone, so two members never apply one key at once.
- inbox and order: each delivery's transaction starts with `outbox_group_record`, which says
  apply, jumped (apply; a seq jump recorded), duplicate or held (the key is blocked); the
  handler runs in that transaction, the ack follows the commit.
- failures: any exception but `Terminal` is retried in place (backoff) up to `max_attempts`;
  then, or at once for `Terminal`, the event is published to `Q.dlx` with a broker confirm on
  a connection of its own and recorded with `outbox_group_dead` (blocking its key with
  on_dead = block-key), then acked. Attempts that cannot be counted in memory, a redelivered
  event's (its member died with it unacked) and a held event's first run in a process, are
  counted in Postgres (`outbox_inbox_attempt`, committed before the handler runs), so an
  event that kills its member is dead-lettered after max_attempts runs.
- released keys: every second the held events of released keys in the owned partitions are
  applied in seq order (`outbox_group_releasable`, `outbox_group_take_held`).

This member applies one event at a time (pika's blocking connection runs one callback at a
time): a key's order holds trivially, and a retried event holds the other keys of all its
partitions too, for up to max_attempts x the backoff. The Rust kit holds only the key.

Needs: psycopg 3 (`pip install "psycopg[binary]" pika`) and pika 1.x.
Run: python3 outbox_group_member.py --queue billing --partitions 8
(the example handler records every applied event in the table example_applied).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import secrets
import signal
import socket
import time
import uuid
from typing import Callable

import pika
import pika.exceptions
import psycopg
from psycopg.types.json import Jsonb

log = logging.getLogger("outbox_group_member")

GROUP_JOIN = "SELECT outbox_group_join(%s, %s)"
GROUP_BEAT = "SELECT m FROM outbox_group_beat(%s, %s, %s) AS m"
GROUP_LEAVE = "SELECT outbox_group_leave(%s, %s)"
GROUP_RECORD = ("SELECT outcome FROM outbox_group_record("
                "%s, %s::integer, %s, %s, %s, %s::bigint, %s, %s, %s, %s)")
GROUP_DEAD = "SELECT outbox_group_dead(%s, %s, %s, %s, %s::bigint, %s, %s)"
# Counts one more attempt of an event, committed before it runs; returns its attempts before.
ATTEMPT = "SELECT outbox_inbox_attempt(%s, %s)"
RELEASABLE = "SELECT aggregate_type, aggregate_id FROM outbox_group_releasable(%s, %s::integer[])"
TAKE_HELD = ("SELECT outcome, event_id, seq, event_type, routing_key, headers, body "
             "FROM outbox_group_take_held(%s, %s, %s)")

H_TYPE = "x-outbox-aggregate-type"
H_ID = "x-outbox-aggregate-id"
H_SEQ = "x-outbox-seq"
H_ROUTING_KEY = "x-outbox-routing-key"
H_DEAD_REASON = "x-outbox-dead-reason"
H_DEAD_CONSUMER = "x-outbox-dead-consumer"


class Terminal(Exception):
    """A failure a retry will not fix: the event is dead-lettered at once."""


@dataclasses.dataclass
class Event:
    event_id: uuid.UUID
    aggregate_type: str
    aggregate_id: str
    seq: int
    event_type: str
    routing_key: str
    headers: dict
    body: bytes
    redelivered: bool = False
    attempt: int = 0

    def payload(self):
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise Terminal(f"body is not JSON: {e}") from e


# handler(cursor, event): runs inside the inbox transaction; commit and ack follow.
Handler = Callable[[psycopg.Cursor, Event], None]


@dataclasses.dataclass
class Settings:
    database_url: str
    amqp_url: str
    queue: str
    partitions: int
    consumer: str
    member_lease: float = 6.0
    max_attempts: int = 5
    retry_min: float = 0.2
    retry_max: float = 5.0
    on_dead: str = "block-key"
    prefetch: int = 16
    name: str = "python"


def partition_queue(queue: str, p: int, partitions: int) -> str:
    width = len(str(max(partitions - 1, 10)))
    return f"{queue}.p{p:0{width}d}"


def assigned(partitions: int, index: int, members: int) -> list[int]:
    return [p for p in range(partitions) if p % max(members, 1) == index]


def _text(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


def _jsonable(v):
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (datetime.datetime, datetime.date)):
        return v.isoformat()
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def parse(props: pika.BasicProperties, delivery, body: bytes) -> Event:
    """An outbox event from a delivery; ValueError if it is not one (no id, key or seq)."""
    headers = dict(props.headers or {})
    try:
        event_id = uuid.UUID(_text(props.message_id) or "")
    except ValueError:
        raise ValueError(f"message_id {props.message_id!r} is not a uuid") from None
    t, i, seq = _text(headers.get(H_TYPE)), _text(headers.get(H_ID)), headers.get(H_SEQ)
    if not t or i is None:
        raise ValueError("no x-outbox-aggregate-type / x-outbox-aggregate-id headers")
    try:
        seq = int(_text(seq) if isinstance(seq, bytes) else seq)
    except (TypeError, ValueError):
        raise ValueError(f"x-outbox-seq {seq!r} is not a number") from None
    return Event(
        event_id=event_id, aggregate_type=t, aggregate_id=i, seq=seq,
        event_type=_text(props.type) or "",
        routing_key=_text(headers.get(H_ROUTING_KEY)) or delivery.routing_key,
        headers=_jsonable(headers), body=body, redelivered=bool(delivery.redelivered))


def close_without_cancel(ch) -> None:
    """Closes a partition's channel with channel.close alone.

    pika's close() first sends basic.cancel for each consumer and then rejects the
    deliveries it holds one by one. basic.cancel makes the broker activate the next
    single-active consumer at once, while this channel still holds unacked deliveries:
    they come back behind events the next owner already got, which it then takes for
    late (older than their key) and never applies. The test suite saw 5 of 400 events
    lost that way. Closing the channel alone returns them in their order first, and
    only then activates the next owner. pika has no option for it: its consumers are
    forgotten locally (pika 1.x internals) so that close() sends channel.close only.
    """
    if not ch.is_open:
        return
    ch._consumer_infos.clear()
    ch._impl._consumers.clear()
    ch.close()


class Member:
    """One member of the group: run() until stop() (SIGTERM)."""

    def __init__(self, settings: Settings, handler: Handler):
        self.s = settings
        self.handler = handler
        self.member = f"{settings.name}#{socket.gethostname()}#{os.getpid()}#{secrets.token_hex(4)}"
        self.stopping = False
        self.db: psycopg.Connection | None = None       # the handlers' transactions
        self.beat_db: psycopg.Connection | None = None  # heartbeats, autocommit
        self.conn: pika.BlockingConnection | None = None
        self.dead_conn: pika.BlockingConnection | None = None
        self.dead_ch = None
        self.owned: dict[int, pika.adapters.blocking_connection.BlockingChannel] = {}
        self.held_failures: dict[uuid.UUID, int] = {}

    def stop(self, *_):
        self.stopping = True

    # --- connections ---------------------------------------------------------------------

    def _pg(self, autocommit: bool) -> psycopg.Connection:
        return psycopg.connect(self.s.database_url, autocommit=autocommit, connect_timeout=10,
                               options="-c statement_timeout=25000",
                               application_name=f"outbox-group-member {self.s.consumer}")

    def _amqp(self, purpose: str) -> pika.BlockingConnection:
        params = pika.URLParameters(self.s.amqp_url)
        params.heartbeat = 10
        params.blocked_connection_timeout = 30
        params.socket_timeout = 10
        params.client_properties = {
            "connection_name": f"outbox-group-member {self.s.consumer} {purpose}"}
        return pika.BlockingConnection(params)

    def _handler_db(self) -> psycopg.Connection:
        if self.db is None or self.db.closed or self.db.broken:
            self.db = self._pg(autocommit=False)
        return self.db

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        delay = self.s.retry_min
        while not self.stopping:
            try:
                self._session()
                delay = self.s.retry_min
            except (pika.exceptions.AMQPError, psycopg.OperationalError, OSError) as e:
                log.warning("session lost (%s); reconnecting in %.1fs", e, delay)
                self._close()
                self._sleep(delay)
                delay = min(delay * 2, self.s.retry_max)
        self._leave()
        self._close()
        log.info("member %s stopped", self.member)

    def _session(self) -> None:
        self.beat_db = self._pg(autocommit=True)
        self.beat_db.execute(GROUP_JOIN, (self.s.consumer, self.s.partitions))
        self.conn = self._amqp("consume")
        last_beat, next_beat, next_drain = time.monotonic(), 0.0, 0.0
        while not self.stopping:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.s.member_lease / 3
                try:
                    members = [r[0] for r in self.beat_db.execute(
                        GROUP_BEAT, (self.s.consumer, self.member,
                                     int(self.s.member_lease * 1000))).fetchall()]
                    last_beat = now
                    index = members.index(self.member) if self.member in members else 0
                    want = assigned(self.s.partitions, index, len(members))
                except psycopg.Error as e:
                    log.warning("heartbeat failed: %s", e)
                    if now - last_beat < self.s.member_lease:
                        want = list(self.owned)
                    else:
                        want = []  # our lease ran out: the others own our partitions now
                    if self.beat_db.closed or self.beat_db.broken:
                        self.beat_db = self._pg(autocommit=True)
                self._assign(want)
            if now >= next_drain and self.owned:
                next_drain = now + 1.0
                self._drain_released()
            # Deliveries are handled inside this call, one at a time.
            self.conn.process_data_events(time_limit=0.2)
            if self.dead_conn is not None:
                self.dead_conn.process_data_events(time_limit=0)

    def _assign(self, want: list[int]) -> None:
        for p in [p for p in self.owned if p not in want]:
            close_without_cancel(self.owned.pop(p))
            log.info("gave up partition %d", p)
        for p in want:
            if p in self.owned:
                continue
            ch = self.conn.channel()
            ch.basic_qos(prefetch_count=self.s.prefetch)
            ch.basic_consume(partition_queue(self.s.queue, p, self.s.partitions),
                             on_message_callback=self._on_delivery(p))
            self.owned[p] = ch
            log.info("took partition %d", p)

    def _on_delivery(self, p: int):
        def cb(ch, delivery, props, body):
            if self.stopping or p not in self.owned:
                return  # left unacked: it goes back to the queue when the channel closes
            try:
                ev = parse(props, delivery, body)
            except ValueError as e:
                # No outbox event: nothing to record or block.
                self._dead_letter(delivery.routing_key, body, props, str(e))
                ch.basic_ack(delivery.delivery_tag)
                return
            if self._apply(p, ev, body, props):
                ch.basic_ack(delivery.delivery_tag)
        return cb

    # --- one event -----------------------------------------------------------------------

    def _count_attempt(self, event_id: uuid.UUID) -> int:
        """Counts one more attempt of the event in the database, committed before it runs;
        returns its attempts before this one (0 when the count cannot be written)."""
        try:
            with self._pg(autocommit=True) as db:
                return db.execute(ATTEMPT, (self.s.consumer, event_id)).fetchone()[0]
        except psycopg.Error as e:
            log.warning("attempt of %s not counted in outbox_inbox_attempts (%s)", event_id, e)
            return 0

    def _apply(self, p: int, ev: Event, body: bytes, props) -> bool:
        """The inbox transaction with retries in place; then dead-lettering. True: ack."""
        attempt = self._count_attempt(ev.event_id) if ev.redelivered else 0
        if attempt >= self.s.max_attempts:
            self._dead_in_group(ev, body, props, f"gave up after {attempt} attempts: its "
                                "deliveries ended unsettled (the member died while handling it)")
            return True
        while True:
            try:
                db = self._handler_db()
                with db.transaction():
                    cur = db.cursor()
                    outcome = cur.execute(GROUP_RECORD, (
                        self.s.consumer, p, ev.event_id, ev.aggregate_type, ev.aggregate_id,
                        ev.seq, ev.event_type, ev.routing_key,
                        Jsonb(ev.headers), body)).fetchone()[0]
                    if outcome == "jumped":
                        log.warning("seq jump on %s/%s to %d (recorded in outbox_inbox_gaps)",
                                    ev.aggregate_type, ev.aggregate_id, ev.seq)
                    if outcome in ("apply", "jumped"):
                        ev.attempt = attempt
                        self.handler(cur, ev)
                return True
            except Terminal as e:
                reason = str(e)
            except Exception as e:  # noqa: BLE001 - anything else is worth a retry
                attempt += 1
                if attempt < self.s.max_attempts and not self.stopping:
                    delay = min(self.s.retry_min * 2 ** (attempt - 1), self.s.retry_max)
                    log.warning("event %s failed (attempt %d), retrying in %.1fs: %s",
                                ev.event_id, attempt, delay, e)
                    self._sleep(delay)
                    continue
                if self.stopping:
                    return False  # unacked: redelivered in order to the next owner
                reason = f"gave up after {attempt} attempts: {e}"
            self._dead_in_group(ev, body, props, reason)
            return True

    def _dead_in_group(self, ev: Event, body: bytes, props, reason: str) -> None:
        self._dead_letter(ev.routing_key, body, props, reason)
        block = self.s.on_dead == "block-key"
        while True:
            try:
                with self._pg(autocommit=True) as db:
                    db.execute(GROUP_DEAD, (self.s.consumer, ev.event_id, ev.aggregate_type,
                                            ev.aggregate_id, ev.seq, reason, block))
                break
            except psycopg.OperationalError as e:
                log.warning("dead letter not recorded yet (%s); retrying", e)
                self._sleep(self.s.retry_min)
        log.warning("dead-lettered %s of %s/%s: %s%s", ev.event_id, ev.aggregate_type,
                    ev.aggregate_id, reason, " (key blocked)" if block else "")

    def _dead_letter(self, routing_key: str, body: bytes, props, reason: str) -> None:
        """Publishes the copy to <queue>.dlx until the broker confirms it."""
        headers = dict(props.headers or {})
        headers.update({H_DEAD_REASON: reason, H_DEAD_CONSUMER: self.s.consumer,
                        H_ROUTING_KEY: routing_key})
        copy = pika.BasicProperties(
            message_id=props.message_id, type=props.type, content_type=props.content_type,
            timestamp=props.timestamp, delivery_mode=2, headers=headers)
        while True:
            try:
                if self.dead_conn is None or not self.dead_conn.is_open:
                    self.dead_conn = self._amqp("dead letters")
                    self.dead_ch = self.dead_conn.channel()
                    self.dead_ch.confirm_delivery()
                # Raises on a nack (confirm mode): nothing is acked until it is confirmed.
                self.dead_ch.basic_publish(f"{self.s.queue}.dlx", routing_key, body, copy)
                return
            except pika.exceptions.AMQPError as e:
                log.warning("dead letter not confirmed (%s); retrying", e)
                self.dead_conn = None
                self._sleep(self.s.retry_min)

    # --- held events of released keys ----------------------------------------------------

    def _drain_released(self) -> None:
        db = self._handler_db()
        with db.transaction():
            keys = db.execute(RELEASABLE, (self.s.consumer, list(self.owned))).fetchall()
        for t, i in keys:
            while not self.stopping and self._apply_held(db, t, i):
                pass

    def _apply_held(self, db: psycopg.Connection, t: str, i: str) -> bool:
        """Applies the key's next held event; False when none is left (or it failed and
        stays held for the next drain)."""
        taken = None
        try:
            with db.transaction():
                cur = db.cursor()
                row = cur.execute(TAKE_HELD, (self.s.consumer, t, i)).fetchone()
                if row is None:
                    return False
                outcome, event_id, seq, event_type, rk, headers, body = row
                taken = Event(event_id=event_id, aggregate_type=t, aggregate_id=i, seq=seq,
                              event_type=event_type or "", routing_key=rk,
                              headers=headers or {}, body=bytes(body), redelivered=True,
                              attempt=self.held_failures.get(event_id, 0))
                if outcome in ("apply", "jumped") and event_id not in self.held_failures:
                    # Its first run in this process: a run that died with an earlier one
                    # rolled its take back, and only the database remembers it.
                    earlier = max(self._count_attempt(event_id) - 1, 0)
                    self.held_failures[event_id] = earlier
                    taken.attempt = earlier
                    if earlier >= self.s.max_attempts:
                        raise Terminal(f"gave up after {earlier} attempts: its runs from the "
                                       "held events ended unsettled (the member died while "
                                       "handling it)")
                if outcome in ("apply", "jumped"):
                    self.handler(cur, taken)
            self.held_failures.pop(taken.event_id, None)
            log.info("applied held event %s/%s seq %d", t, i, taken.seq)
            return True
        except psycopg.OperationalError:
            raise
        except Exception as e:  # noqa: BLE001 - the rollback left it held
            if taken is None:
                raise
            n = self.held_failures.get(taken.event_id, 0) + 1
            self.held_failures[taken.event_id] = n
            if not isinstance(e, Terminal) and n < self.s.max_attempts:
                log.warning("held event %s failed (attempt %d): %s", taken.event_id, n, e)
                return False
            self.held_failures.pop(taken.event_id, None)
            props = pika.BasicProperties(message_id=str(taken.event_id), type=taken.event_type,
                                         content_type="application/json", delivery_mode=2,
                                         headers=dict(taken.headers))
            self._dead_in_group(taken, taken.body, props,
                                str(e) if isinstance(e, Terminal)
                                else f"gave up after {n} attempts: {e}")
            return True

    # --- ending --------------------------------------------------------------------------

    def _leave(self) -> None:
        try:
            with self._pg(autocommit=True) as db:
                db.execute(GROUP_LEAVE, (self.s.consumer, self.member))
        except psycopg.Error as e:
            log.warning("could not leave the group (%s); the lease runs out instead", e)

    def _close(self) -> None:
        for ch in self.owned.values():
            try:
                close_without_cancel(ch)
            except pika.exceptions.AMQPError:
                pass
        self.owned.clear()
        for c in (self.conn, self.dead_conn):
            try:
                if c is not None and c.is_open:
                    c.close()
            except pika.exceptions.AMQPError:
                pass
        self.conn = self.dead_conn = None
        for d in (self.db, self.beat_db):
            if d is not None:
                d.close()
        self.db = self.beat_db = None

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.05, end - time.monotonic()))


# --- the example: a handler that records what it applied ---------------------------------

EXAMPLE_TABLE = """
CREATE TABLE IF NOT EXISTS example_applied (
    n              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer       text NOT NULL,
    member         text NOT NULL,
    event_id       uuid NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    seq            bigint NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now()
)"""


def example_handler(member: Member, exit_on_type: str | None = None) -> Handler:
    def handle(cur: psycopg.Cursor, ev: Event) -> None:
        if exit_on_type is not None and ev.event_type == exit_on_type:
            # To try out an event that kills its member (as out of memory would).
            log.error("event %s of type %s: exiting, as asked", ev.event_id, ev.event_type)
            os._exit(70)
        ev.payload()  # a body that is not JSON is dead-lettered (Terminal)
        cur.execute(
            "INSERT INTO example_applied (consumer, member, event_id, aggregate_type,"
            " aggregate_id, seq) VALUES (%s, %s, %s, %s, %s, %s)",
            (member.s.consumer, member.member, ev.event_id, ev.aggregate_type,
             ev.aggregate_id, ev.seq))
    return handle


def main() -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--database-url", default=env("DATABASE_URL",
                                                  "postgres://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--amqp-url", default=env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
    ap.add_argument("--queue", default=env("OUTBOX_GROUP_QUEUE"), required=not env("OUTBOX_GROUP_QUEUE"))
    ap.add_argument("--partitions", type=int, default=int(env("OUTBOX_GROUP_PARTITIONS", "8")))
    ap.add_argument("--consumer", default=env("OUTBOX_CONSUMER"),
                    help="the group's name (default: the queue), as the router's --consumer")
    ap.add_argument("--member-lease", type=float, default=float(env("OUTBOX_MEMBER_LEASE", "6")))
    ap.add_argument("--max-attempts", type=int, default=int(env("OUTBOX_MAX_ATTEMPTS", "5")))
    ap.add_argument("--on-dead", choices=["block-key", "continue"],
                    default=env("OUTBOX_ON_DEAD", "block-key"))
    ap.add_argument("--name", default=env("OUTBOX_MEMBER_NAME", "python"))
    ap.add_argument("--exit-on-type", default=env("OUTBOX_EXAMPLE_EXIT_ON_TYPE"),
                    help="end the process when an event of this type is handled (to try out "
                         "an event that kills its member: it is dead-lettered after "
                         "max-attempts runs)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    settings = Settings(database_url=a.database_url, amqp_url=a.amqp_url, queue=a.queue,
                        partitions=a.partitions, consumer=a.consumer or a.queue,
                        member_lease=a.member_lease, max_attempts=a.max_attempts,
                        on_dead=a.on_dead, name=a.name)
    with psycopg.connect(settings.database_url, autocommit=True, connect_timeout=10) as db:
        try:
            db.execute(EXAMPLE_TABLE)
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
            pass  # another member created it at the same moment
    member = Member(settings, lambda cur, ev: None)
    member.handler = example_handler(member, a.exit_on_type)
    signal.signal(signal.SIGTERM, member.stop)
    signal.signal(signal.SIGINT, member.stop)
    log.info("member %s of group %s (%d partitions of %s)", member.member, settings.consumer,
             settings.partitions, settings.queue)
    member.run()


if __name__ == "__main__":
    main()
