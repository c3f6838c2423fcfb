-- outbox-relay migration 0001: the outbox table, the producer function and the wake-up trigger.
--
-- Plain SQL: apply it with any migration tool after `SET search_path TO <schema>`;
-- `outbox-relay migrate` does exactly that. Functions capture the schema with
-- `SET search_path FROM CURRENT`, so they work whatever the caller's search_path is.

-- Header names the relay owns or that change routing (RabbitMQ's sender-selected
-- distribution uses CC and BCC) are refused at insert, with this constraint's name in the error.
CREATE FUNCTION outbox_headers_allowed(h jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT jsonb_typeof(h) = 'object'
       AND NOT EXISTS (
            SELECT 1 FROM jsonb_object_keys(h) AS k
             WHERE upper(k) IN ('CC', 'BCC')
                OR lower(k) LIKE 'x-outbox-%'
                OR lower(k) IN ('traceparent', 'tracestate')
                OR octet_length(k) > 255
                OR k = '')
$$;

CREATE TABLE outbox_events (
    -- generated
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id       uuid NOT NULL DEFAULT gen_random_uuid(),
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- written by producers
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    event_type     text NOT NULL,
    payload        jsonb NOT NULL,
    headers        jsonb NOT NULL DEFAULT '{}',
    routing_key    text,
    available_at   timestamptz NOT NULL DEFAULT now(),
    traceparent    text,
    tracestate     text,
    -- managed by the relay
    dispatched_at  timestamptz,
    attempts       integer NOT NULL DEFAULT 0,
    last_error     text,
    parked_at      timestamptz,
    seq            bigint,
    CONSTRAINT outbox_events_event_id_key UNIQUE (event_id),
    CONSTRAINT outbox_events_headers_reserved
        CHECK (headers = '{}'::jsonb OR outbox_headers_allowed(headers)),
    CONSTRAINT outbox_events_routing_key_length
        CHECK (routing_key IS NULL OR octet_length(routing_key) <= 255)
);

-- Every event is updated twice (numbered, then marked dispatched) and neither update can be
-- HOT (both touch indexed columns), so dead versions pile up fast: vacuum early and often
-- instead of at the default 20% of the table.
ALTER TABLE outbox_events SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 1
);

-- Claiming scans pending rows in id order; dispatched and parked rows leave this index,
-- so its size follows the backlog, not the table.
CREATE INDEX outbox_events_pending ON outbox_events (id)
    WHERE dispatched_at IS NULL AND parked_at IS NULL;

-- Per-key order: a key's pending rows in publish order (assigned seq first, then id).
CREATE INDEX outbox_events_pending_key ON outbox_events (aggregate_type, aggregate_id, seq, id)
    WHERE dispatched_at IS NULL AND parked_at IS NULL;

-- Dispatched rows by time (retention deletes old ones; `status` counts the last minute).
-- BRIN, not a b-tree: rows are dispatched roughly in table order, so block ranges summarize
-- them well, and marking a row dispatched does not write a b-tree entry.
CREATE INDEX outbox_events_dispatched ON outbox_events USING brin (dispatched_at)
    WITH (autosummarize = on);

-- Parked rows by key (for --on-park block-key and the operator commands).
CREATE INDEX outbox_events_parked ON outbox_events (aggregate_type, aggregate_id)
    WHERE parked_at IS NOT NULL;

-- The last seq handed out per key. Kept apart from the events so that deleting old
-- dispatched rows never restarts a key's sequence.
CREATE TABLE outbox_key_seq (
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- Keys are spread over 64 partitions; a relay publishes only rows of partitions it leases.
CREATE FUNCTION outbox_partition_of(aggregate_type text, aggregate_id text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtext(aggregate_type || E'\x1f' || aggregate_id) & 63 $$;

CREATE TABLE outbox_partitions (
    partition   integer PRIMARY KEY CHECK (partition BETWEEN 0 AND 63),
    owner       text,
    epoch       bigint NOT NULL DEFAULT 0,
    lease_until timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO outbox_partitions (partition) SELECT g FROM generate_series(0, 63) AS g;

-- Relays alive (heartbeat) and whether each wants a NOTIFY on insert.
CREATE TABLE outbox_relays (
    relay_id     text PRIMARY KEY,
    host         text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    lease_secs   double precision NOT NULL,
    wants_wakeup boolean NOT NULL DEFAULT true,
    -- Rows this relay has published and seen acked since it started (for `status`).
    published    bigint NOT NULL DEFAULT 0
);

-- The wake-up hint. A NOTIFY takes a database-wide lock at commit, so producers send one
-- only while some live relay has said it is idle; a busy relay polls back to back and
-- turns the hint off. A relay that turns it back on polls once more afterwards, which
-- closes the race with a producer that committed in between.
CREATE FUNCTION outbox_wakeup() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_relays
                WHERE wants_wakeup
                  AND heartbeat_at > now() - make_interval(secs => 3 * lease_secs)) THEN
        PERFORM pg_notify('outbox_events:' || TG_TABLE_SCHEMA, '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_events_wakeup AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_wakeup();

-- The producer function: the same as a plain INSERT of the four required columns.
CREATE FUNCTION outbox_enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}',
    available_at   timestamptz DEFAULT now()
) RETURNS uuid
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers, available_at)
    VALUES ($1, $2, $3, $4, coalesce($5, '{}'), coalesce($6, now()))
    RETURNING event_id
$$;
