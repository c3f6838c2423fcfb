-- outbox-relay migration 0002: the relay's coordination functions.
--
-- Relays coordinate only through Postgres. Keys are spread over 64 partitions
-- (outbox_partition_of); each partition is leased by at most one relay at a time
-- (outbox_lease), and only the leaseholder claims, numbers and publishes its rows
-- (outbox_claim). A lease that is not renewed expires and another relay takes the
-- partition over. Claims hold a shared advisory lock that take-overs hold exclusively,
-- so a partition never changes hands while a claim is numbering its rows.

CREATE FUNCTION outbox_claim_lock_key() RETURNS bigint
LANGUAGE sql STABLE SET search_path FROM CURRENT
AS $$ SELECT hashtextextended('outbox-relay:claim:' || current_schema(), 0) $$;

-- Renew this relay's heartbeat and leases, give back `p_release`, and take free or
-- expired partitions up to a fair share (64 / live relays, rounded up).
-- Returns the partitions this relay holds after the call.
CREATE FUNCTION outbox_lease(
    p_relay text,
    p_host text,
    p_pid integer,
    p_lease_secs double precision,
    p_release integer[],
    p_acquire boolean,
    p_wants_wakeup boolean,
    p_published bigint
) RETURNS TABLE (partition integer, epoch bigint, fair_share integer, relays_alive integer)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_lease interval := make_interval(secs => p_lease_secs);
    v_alive integer;
    v_fair  integer;
    v_owned integer;
BEGIN
    INSERT INTO outbox_relays AS r (relay_id, host, pid, lease_secs, wants_wakeup)
    VALUES (p_relay, p_host, p_pid, p_lease_secs, p_wants_wakeup)
    ON CONFLICT (relay_id) DO UPDATE
        SET heartbeat_at = now(), lease_secs = excluded.lease_secs, published = p_published;

    -- Forget relays that have been silent for ten leases.
    DELETE FROM outbox_relays r
     WHERE r.heartbeat_at < now() - make_interval(secs => 10 * r.lease_secs);

    UPDATE outbox_partitions p SET owner = NULL, lease_until = '-infinity'
     WHERE p.owner = p_relay AND p.partition = ANY (coalesce(p_release, '{}'));

    UPDATE outbox_partitions p SET lease_until = now() + v_lease
     WHERE p.owner = p_relay;

    SELECT count(*) INTO v_alive FROM outbox_relays r
     WHERE r.heartbeat_at > now() - make_interval(secs => r.lease_secs);
    v_fair := ceil(64.0 / greatest(v_alive, 1));

    SELECT count(*) INTO v_owned FROM outbox_partitions p WHERE p.owner = p_relay;

    IF p_acquire AND v_owned < v_fair
       AND EXISTS (SELECT 1 FROM outbox_partitions p
                    WHERE p.owner IS NULL OR p.lease_until < clock_timestamp()) THEN
        -- Wait for running claims to finish: the new owner must see every seq they assigned.
        PERFORM pg_advisory_xact_lock(outbox_claim_lock_key());
        UPDATE outbox_partitions p
           SET owner = p_relay, epoch = p.epoch + 1, lease_until = clock_timestamp() + v_lease
         WHERE p.partition IN (
               SELECT q.partition FROM outbox_partitions q
                WHERE q.owner IS NULL OR q.lease_until < clock_timestamp()
                ORDER BY q.partition
                LIMIT v_fair - v_owned
                  FOR UPDATE SKIP LOCKED);
    END IF;

    RETURN QUERY
        SELECT p.partition, p.epoch, v_fair, v_alive
          FROM outbox_partitions p
         WHERE p.owner = p_relay
         ORDER BY p.partition;
END
$$;

-- Give back every partition and leave (a clean shutdown): others take over at once.
CREATE FUNCTION outbox_leave(p_relay text) RETURNS void
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    UPDATE outbox_partitions SET owner = NULL, lease_until = '-infinity' WHERE owner = p_relay;
    DELETE FROM outbox_relays WHERE relay_id = p_relay;
$$;

-- Claim the next chunk of this relay's rows, numbering each key's new rows.
--
-- Scans up to p_limit pending, available rows of the leased partitions with id > p_after
-- (and id <= p_before when given). The relay reads forward from its cursor and, every poll
-- interval, sweeps the range below the cursor again from 0 (p_before = the cursor), so a
-- row that commits late with a lower id is found by the next sweep: there is no high-water
-- mark, and a sweep never sets the forward cursor back.
-- plus the keys the relay names in p_key_types/p_key_ids (keys whose earlier rows it has
-- published and that may have more). For each key it returns a prefix of that key's
-- pending rows in publish order (rows already numbered by seq, then new rows by id), so a
-- key's row is never returned without the rows that must be published before it. The
-- prefix is shallow when many keys are waiting (p_limit spread over them, at most
-- p_per_key), so one claim fills the relay's window across many keys, and deep for a hot
-- key. New rows get the key's next seq numbers here, committed before anything is
-- published, so a row published again carries the same seq.
--
-- The first row returned is a header (id IS NULL) carrying where the next claim should
-- start (scanned_to), how many candidates the scan found (scanned; fewer than p_limit means
-- it reached the end) and the prefix depth used (per_key). Bodies of rows whose payload text
-- is larger than p_max_message_bytes come back NULL (the relay parks them). Rows are cut
-- so that the bodies returned stay within p_max_bytes (at least one row is returned).
CREATE FUNCTION outbox_claim(
    p_relay text,
    p_after bigint,
    p_limit integer,
    p_per_key integer,
    p_block_parked_keys boolean,
    p_max_message_bytes integer,
    p_max_bytes bigint,
    p_key_types text[] DEFAULT '{}',
    p_key_ids text[] DEFAULT '{}',
    p_before bigint DEFAULT NULL
) RETURNS TABLE (
    id bigint,
    event_id uuid,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    routing_key text,
    body text,
    body_bytes integer,
    headers text,
    traceparent text,
    tracestate text,
    created_epoch double precision,
    created_text text,
    attempts integer,
    seq bigint,
    partition integer,
    scanned_to bigint,
    scanned integer,
    per_key integer
)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_owned   integer[];
    v_all     boolean;
    v_scanned_to bigint;
    v_scanned integer;
    v_types   text[];
    v_ids     text[];
    v_firsts  bigint[];
    v_per_key integer;
    v_picked  bigint[];
    v_cut     bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());

    SELECT array_agg(p.partition) INTO v_owned
      FROM outbox_partitions p
     WHERE p.owner = p_relay AND p.lease_until > clock_timestamp();
    IF v_owned IS NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                            NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                            NULL::integer, p_after, 0, 0;
        RETURN;
    END IF;
    v_all := cardinality(v_owned) = 64;

    -- Keys to look at: those the relay named (first), then those of the candidate rows in
    -- order of their oldest candidate.
    WITH cand AS (
        SELECT e.id, e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= now()
           AND e.id > p_after
           AND (p_before IS NULL OR e.id <= p_before)
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (v_owned))
         ORDER BY e.id
         LIMIT p_limit
    ), named AS (
        SELECT n.aggregate_type, n.aggregate_id, 0::bigint AS first_id
          FROM unnest(p_key_types, p_key_ids) AS n(aggregate_type, aggregate_id)
         WHERE v_all OR outbox_partition_of(n.aggregate_type, n.aggregate_id) = ANY (v_owned)
    ), keys AS (
        SELECT u.aggregate_type, u.aggregate_id, min(u.first_id) AS first_id
          FROM (SELECT c.aggregate_type, c.aggregate_id, c.id AS first_id FROM cand c
                UNION ALL
                SELECT * FROM named) u
         GROUP BY u.aggregate_type, u.aggregate_id
    )
    SELECT (SELECT max(c.id) FROM cand c),
           (SELECT count(*) FROM cand c),
           array_agg(k.aggregate_type ORDER BY k.first_id),
           array_agg(k.aggregate_id ORDER BY k.first_id),
           array_agg(k.first_id ORDER BY k.first_id)
      INTO v_scanned_to, v_scanned, v_types, v_ids, v_firsts
      FROM keys k
     WHERE NOT p_block_parked_keys
        OR NOT EXISTS (SELECT 1 FROM outbox_events x
                        WHERE x.aggregate_type = k.aggregate_type
                          AND x.aggregate_id = k.aggregate_id
                          AND x.parked_at IS NOT NULL);

    -- Spread p_limit over the keys waiting: shallow prefixes for many keys, deep for few.
    v_per_key := greatest(1, least(p_per_key, ceil(p_limit::numeric / greatest(coalesce(cardinality(v_types), 0), 1))::integer));

    -- Each key's prefix, keys in order. Keys that do not fit in p_limit rows are left for
    -- the next claim: the cursor stops before the first candidate of the first such key.
    WITH q AS (
        SELECT k.ord, k.first_id, x.id, x.seq
          FROM unnest(v_types, v_ids, v_firsts) WITH ORDINALITY AS k(aggregate_type, aggregate_id, first_id, ord)
         CROSS JOIN LATERAL (
               SELECT e.id, e.seq
                 FROM outbox_events e
                WHERE e.aggregate_type = k.aggregate_type
                  AND e.aggregate_id = k.aggregate_id
                  AND e.dispatched_at IS NULL AND e.parked_at IS NULL
                  AND e.available_at <= now()
                ORDER BY e.seq NULLS LAST, e.id
                LIMIT v_per_key) x
    ), n AS (
        SELECT q.*, row_number() OVER (ORDER BY q.ord, q.seq NULLS LAST, q.id) AS n FROM q
    )
    SELECT array_agg(n.id ORDER BY n.n) FILTER (WHERE n.n <= p_limit),
           min(n.first_id) FILTER (WHERE n.n > p_limit AND n.first_id > 0)
      INTO v_picked, v_cut
      FROM n;
    IF v_cut IS NOT NULL THEN
        v_scanned_to := v_cut - 1;
    END IF;

    WITH need AS (
        SELECT e.id, e.aggregate_type, e.aggregate_id,
               row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.id) AS rn,
               count(*) OVER (PARTITION BY e.aggregate_type, e.aggregate_id) AS n
          FROM outbox_events e
         WHERE e.id = ANY (v_picked) AND e.seq IS NULL
    ), bumped AS (
        INSERT INTO outbox_key_seq AS s (aggregate_type, aggregate_id, last_seq)
        SELECT DISTINCT need.aggregate_type, need.aggregate_id, need.n FROM need
        ON CONFLICT (aggregate_type, aggregate_id)
        DO UPDATE SET last_seq = s.last_seq + excluded.last_seq
        RETURNING s.aggregate_type, s.aggregate_id, s.last_seq
    )
    UPDATE outbox_events e
       SET seq = b.last_seq - need.n + need.rn
      FROM need
      JOIN bumped b ON b.aggregate_type = need.aggregate_type AND b.aggregate_id = need.aggregate_id
     WHERE e.id = need.id;

    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                        NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                        NULL::integer, coalesce(v_scanned_to, p_after), coalesce(v_scanned, 0), v_per_key;

    RETURN QUERY
    WITH r AS (
        SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
               coalesce(e.routing_key, e.aggregate_type || '.' || e.event_type) AS routing_key,
               e.payload::text AS body, e.headers::text AS headers, e.traceparent, e.tracestate,
               extract(epoch FROM e.created_at)::float8 AS created_epoch,
               to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS created_text,
               e.attempts, e.seq,
               outbox_partition_of(e.aggregate_type, e.aggregate_id) AS partition,
               p.ord
          FROM unnest(v_picked) WITH ORDINALITY AS p(id, ord)
          JOIN outbox_events e ON e.id = p.id
    ), sized AS (
        SELECT r.*, octet_length(r.body) AS body_bytes,
               sum(CASE WHEN octet_length(r.body) > p_max_message_bytes THEN 0
                        ELSE octet_length(r.body) END) OVER (ORDER BY r.ord) AS running
          FROM r
    )
    SELECT s.id, s.event_id, s.aggregate_type, s.aggregate_id, s.event_type, s.routing_key,
           CASE WHEN s.body_bytes > p_max_message_bytes THEN NULL ELSE s.body END,
           s.body_bytes, s.headers, s.traceparent, s.tracestate, s.created_epoch, s.created_text,
           s.attempts, s.seq, s.partition, NULL::bigint, NULL::integer, NULL::integer
      FROM sized s
     WHERE s.ord = 1 OR s.running <= p_max_bytes
     ORDER BY s.ord;
END
$$;

-- Record failed publish attempts: attempts + 1 and the reason; park rows that cannot be
-- published (kind 2) or that the broker returned (kind 1) once they reach p_max_attempts;
-- kind 0 (nack, timeout, lost connection) never parks.
--
-- With p_block_key, the later rows of a parked row's key lose their (unpublished) numbers
-- and the key's counter goes back to the parked row's seq: nothing after a parked row is
-- published while it is parked, so when it is re-driven it keeps its number and the key
-- goes on gaplessly.
CREATE FUNCTION outbox_record_failures(
    p_ids bigint[],
    p_reasons text[],
    p_kinds smallint[],
    p_max_attempts integer,
    p_block_key boolean
) RETURNS TABLE (id bigint, attempts integer, parked boolean)
LANGUAGE sql SET search_path FROM CURRENT
AS $$
    WITH f AS (
        SELECT * FROM unnest(p_ids, p_reasons, p_kinds) AS f(id, reason, kind)
    ), u AS (
        UPDATE outbox_events e
           SET attempts = e.attempts + 1,
               last_error = f.reason,
               parked_at = CASE WHEN f.kind = 2 OR (f.kind = 1 AND e.attempts + 1 >= p_max_attempts)
                                THEN now() END
          FROM f
         WHERE e.id = f.id AND e.dispatched_at IS NULL AND e.parked_at IS NULL
        RETURNING e.id, e.aggregate_type, e.aggregate_id, e.seq, e.attempts,
                  e.parked_at IS NOT NULL AS parked
    ), unnumbered AS (
        -- One failed row per key per call (the relay has one unconfirmed row per key),
        -- so these are never rows of u.
        UPDATE outbox_events o SET seq = NULL
          FROM u
         WHERE p_block_key AND u.parked
           AND o.aggregate_type = u.aggregate_type AND o.aggregate_id = u.aggregate_id
           AND o.seq > u.seq AND o.dispatched_at IS NULL AND o.parked_at IS NULL
        RETURNING o.id
    ), rewound AS (
        UPDATE outbox_key_seq k SET last_seq = u.seq
          FROM u
         WHERE p_block_key AND u.parked
           AND k.aggregate_type = u.aggregate_type AND k.aggregate_id = u.aggregate_id
           AND k.last_seq > u.seq
        RETURNING k.last_seq
    )
    SELECT u.id, u.attempts, u.parked FROM u
$$;

-- Put parked rows back to pending with attempts reset (the operator's re-drive).
--
-- Numbering: a re-driven row keeps its seq when no other row of its key has a higher one
-- (nothing after it was numbered: --on-park block-key); otherwise every re-driven row of
-- that key gets a new number after the key's last, in id order, so consumers never see a
-- seq go backwards. With p_dry_run nothing changes; the rows that would are returned.
CREATE FUNCTION outbox_redrive(p_ids bigint[], p_dry_run boolean DEFAULT false)
RETURNS TABLE (id bigint, event_id uuid, aggregate_type text, aggregate_id text, seq_before bigint, renumbered boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH sel AS (
        SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.seq
          FROM outbox_events e
         WHERE e.id = ANY (p_ids) AND e.parked_at IS NOT NULL
    ), renumber AS (
        SELECT DISTINCT s.aggregate_type, s.aggregate_id
          FROM sel s
         WHERE EXISTS (SELECT 1 FROM outbox_events o
                        WHERE o.aggregate_type = s.aggregate_type AND o.aggregate_id = s.aggregate_id
                          AND o.seq > s.seq AND NOT (o.id = ANY (p_ids)))
    ), plan AS (
        SELECT s.*, EXISTS (SELECT 1 FROM renumber r
                             WHERE r.aggregate_type = s.aggregate_type
                               AND r.aggregate_id = s.aggregate_id) AS renumbered
          FROM sel s
    ), redriven AS (
        UPDATE outbox_events e
           SET parked_at = NULL,
               attempts = 0,
               seq = CASE WHEN plan.renumbered THEN NULL ELSE e.seq END
          FROM plan
         WHERE e.id = plan.id AND NOT p_dry_run
        RETURNING e.id
    )
    SELECT plan.id, plan.event_id, plan.aggregate_type, plan.aggregate_id, plan.seq, plan.renumbered
      FROM plan
     ORDER BY plan.id;

    IF NOT p_dry_run THEN
        PERFORM pg_notify('outbox_events:' || current_schema(), '');
    END IF;
END
$$;
