-- Events are numbered when they are inserted; a claim only reads.
--
-- Until now a claim numbered each key's new rows in outbox_key_seq (0007, 0013), so every
-- claim wrote and committed with a WAL flush, a few hundred times a second at 500 events/s.
-- Now a producer's INSERT takes its key's next seq under the key's counter row
-- (outbox_key_seq, trigger outbox_events_number). The row lock is held to the producer's
-- commit, so a key's seqs commit in order, a rollback takes its number back, and a claim
-- that sees a key's row sees every lower number of the key (the earlier holder committed
-- before the later one could take the lock). Producers of one key wait for each other
-- until commit; a transaction writing several keys takes their counters in the order it
-- writes them (two such transactions in opposite orders can deadlock: write keys in one
-- order). The claim is now reads only: which keys, each key's next rows by seq, the rows.
--
-- Slower paths, each writes only when it has work:
-- - A scheduled row (available_at later than created_at) is inserted without a number
--   (numbering it at insert would hold its key's later rows until it is due); the claim
--   numbers it once due (outbox_number_due), after the rows its key already numbered. So
--   seq stays the publish order per key. The same function numbers any pending row left
--   without a number (rows written while triggers were off).
-- - A re-drive numbers the rows it renumbers itself, under the key's counter.
-- - A block-key park no longer rewinds the key: its later rows keep their numbers and wait
--   (the claim skips keys with a parked row); the key's counter records the parked seq
--   (blocked_seq) so that a re-drive knows those rows never went out and keeps the number.
--   With --on-park continue the parked row's number stays a gap, as before.
--
-- Upgrade while relays of the previous version run: this migration waits for running
-- claims and keeps new ones out until it commits (the claim lock), and holds inserts and
-- marks meanwhile (the table lock). Rows a claim numbered and not yet final get their
-- number in outbox_events.seq (the relay that holds them publishes and marks them with the
-- same one); every other pending row without a number that is due gets its key's next
-- numbers in id order, after the highest number any row of the key carries. The functions
-- keep their signatures and results, so a relay of the previous version calls the new
-- bodies. outbox_key_seq.numbered_ids/numbered_seqs are left empty and unused (dropped in
-- a later release). Run this file in one transaction (as `outbox-relay migrate` does).

SELECT pg_advisory_xact_lock(outbox_claim_lock_key());
LOCK TABLE outbox_events IN SHARE ROW EXCLUSIVE MODE;

ALTER TABLE outbox_key_seq ADD COLUMN blocked_seq bigint;

-- Pending rows without a number: scheduled rows until they are due (and, briefly, rows
-- whose key a producer held when they became due).
CREATE INDEX outbox_events_unnumbered ON outbox_events (available_at, id)
    WHERE seq IS NULL AND dispatched_at IS NULL AND parked_at IS NULL;

-- Rows numbered by a claim and not final yet carry their number in the row.
UPDATE outbox_events e SET seq = n.seq
  FROM outbox_key_seq k, unnest(k.numbered_ids, k.numbered_seqs) AS n(id, seq)
 WHERE e.id = n.id AND e.aggregate_type = k.aggregate_type AND e.aggregate_id = k.aggregate_id
   AND e.dispatched_at IS NULL AND e.parked_at IS NULL;
UPDATE outbox_key_seq SET numbered_ids = '{}', numbered_seqs = '{}'
 WHERE numbered_ids <> '{}' OR numbered_seqs <> '{}';

-- A key an earlier version's block-key park rewound: its counter stands at the parked row's
-- number and the rows behind it were given back their numbers. It is held there now
-- (blocked_seq), so that a re-drive keeps the parked row's number and it goes out before
-- the key's later rows, as it did before.
UPDATE outbox_key_seq k SET blocked_seq = k.last_seq
 WHERE EXISTS (SELECT 1 FROM outbox_events e
                WHERE e.aggregate_type = k.aggregate_type AND e.aggregate_id = k.aggregate_id
                  AND e.parked_at IS NOT NULL AND e.dispatched_at IS NULL
                  AND e.seq = k.last_seq);

-- Counters of keys with unnumbered pending rows or parked rows (a block-key park rewound
-- its key) start above every number the key's rows carry; each such key has one.
INSERT INTO outbox_key_seq AS k (aggregate_type, aggregate_id, last_seq)
SELECT e.aggregate_type, e.aggregate_id, coalesce(max(e.seq), 0)
  FROM outbox_events e
 WHERE (e.aggregate_type, e.aggregate_id) IN (
        SELECT u.aggregate_type, u.aggregate_id FROM outbox_events u
         WHERE (u.seq IS NULL AND u.dispatched_at IS NULL AND u.parked_at IS NULL)
            OR u.parked_at IS NOT NULL)
 GROUP BY e.aggregate_type, e.aggregate_id
ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = greatest(k.last_seq, excluded.last_seq);

-- Pending rows without a number that are due: the key's next numbers, in id order (the
-- order the old claim numbered them in).
WITH due AS (
    SELECT e.id, e.aggregate_type, e.aggregate_id,
           row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.id) AS rk
      FROM outbox_events e
     WHERE e.seq IS NULL AND e.dispatched_at IS NULL AND e.parked_at IS NULL
       AND e.available_at <= now()
), counted AS (
    UPDATE outbox_key_seq k SET last_seq = k.last_seq + d.n
      FROM (SELECT due.aggregate_type, due.aggregate_id, count(*) AS n
              FROM due GROUP BY due.aggregate_type, due.aggregate_id) d
     WHERE k.aggregate_type = d.aggregate_type AND k.aggregate_id = d.aggregate_id
    RETURNING k.aggregate_type, k.aggregate_id, k.last_seq - d.n AS base
)
UPDATE outbox_events e SET seq = c.base + d.rk
  FROM due d JOIN counted c ON c.aggregate_type = d.aggregate_type AND c.aggregate_id = d.aggregate_id
 WHERE e.id = d.id;

-- The insert trigger. It runs as the owner (producers need no grant on outbox_key_seq and
-- cannot move a counter themselves), so its search_path is pinned to this schema with
-- pg_temp last, like outbox_refresh_statistics (0009).
DO $do$
BEGIN
    EXECUTE format($f$
CREATE FUNCTION %1$I.outbox_number_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = %1$I, pg_temp
AS $$
BEGIN
    IF NEW.available_at > NEW.created_at THEN
        -- Scheduled: numbered once due (outbox_number_due). The key gets its counter now,
        -- so that numbering it later never has to wait for a producer creating it.
        NEW.seq := NULL;
        INSERT INTO %1$I.outbox_key_seq (aggregate_type, aggregate_id, last_seq)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 0)
        ON CONFLICT DO NOTHING;
        RETURN NEW;
    END IF;
    INSERT INTO %1$I.outbox_key_seq AS k (aggregate_type, aggregate_id, last_seq)
    VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = k.last_seq + 1
    RETURNING k.last_seq INTO NEW.seq;
    -- An event_id already stored (a producer passing its own, again): this INSERT fails,
    -- or is skipped by ON CONFLICT DO NOTHING, after this trigger. Its number goes back
    -- (the key's row is still ours), so that no number is left without an event. A
    -- second INSERT of the key waited for the first to commit, so it sees the first's row.
    IF EXISTS (SELECT 1 FROM %1$I.outbox_events e WHERE e.event_id = NEW.event_id) THEN
        UPDATE %1$I.outbox_key_seq k SET last_seq = k.last_seq - 1
         WHERE k.aggregate_type = NEW.aggregate_type AND k.aggregate_id = NEW.aggregate_id;
        NEW.seq := NULL;
    END IF;
    RETURN NEW;
END
$$
$f$, current_schema());
END
$do$;

CREATE TRIGGER outbox_events_number BEFORE INSERT ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_number_event();

-- The message's size as published: body, user headers, trace context and the text that
-- becomes properties and headers (key, type, routing key). The one definition: the claim
-- returns it (body_bytes) and the relay counts it against its limits.
CREATE FUNCTION outbox_message_bytes(
    aggregate_type text, aggregate_id text, event_type text, routing_key text,
    body text, headers text, traceparent text, tracestate text
) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT octet_length(body) + octet_length(headers)
           + coalesce(octet_length(traceparent), 0) + coalesce(octet_length(tracestate), 0)
           + octet_length(aggregate_type) + octet_length(aggregate_id)
           + octet_length(event_type) + octet_length(routing_key)
$$;

-- Numbers pending rows that are due and have no number yet (scheduled rows now due, rows
-- written while triggers were off), earliest due first, at most p_limit, in partitions
-- p_owned: each takes its key's next seq under the key's counter. A key whose counter a
-- producer holds (its insert not committed) is skipped, never waited for: a later claim
-- numbers it. Returns the keys it numbered rows of. Writes only when such rows exist.
CREATE FUNCTION outbox_number_due(p_owned integer[], p_limit integer)
RETURNS TABLE (aggregate_type text, aggregate_id text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    r         record;
    v_seq     bigint;
    -- Keys whose counter a producer held: their later due rows wait too, so that a key's
    -- scheduled rows take their numbers in the order they became due.
    v_skipped text[] := '{}';
BEGIN
    FOR r IN
        SELECT e.id, e.aggregate_type AS t, e.aggregate_id AS i
          FROM outbox_events e
         WHERE e.seq IS NULL AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= now()
           AND outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (p_owned)
         ORDER BY e.available_at, e.id
         LIMIT p_limit
    LOOP
        CONTINUE WHEN r.t || chr(31) || r.i = ANY (v_skipped);
        SELECT k.last_seq INTO v_seq FROM outbox_key_seq k
         WHERE k.aggregate_type = r.t AND k.aggregate_id = r.i
           FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            IF EXISTS (SELECT 1 FROM outbox_key_seq k
                        WHERE k.aggregate_type = r.t AND k.aggregate_id = r.i) THEN
                v_skipped := v_skipped || (r.t || chr(31) || r.i);
                CONTINUE;
            END IF;
            INSERT INTO outbox_key_seq (aggregate_type, aggregate_id, last_seq)
            VALUES (r.t, r.i, 0)
            ON CONFLICT DO NOTHING
            RETURNING last_seq INTO v_seq;
            IF v_seq IS NULL THEN
                v_skipped := v_skipped || (r.t || chr(31) || r.i);
                CONTINUE;
            END IF;
        END IF;
        UPDATE outbox_events e SET seq = v_seq + 1
         WHERE e.id = r.id AND e.seq IS NULL AND e.dispatched_at IS NULL AND e.parked_at IS NULL;
        CONTINUE WHEN NOT FOUND;
        UPDATE outbox_key_seq k SET last_seq = v_seq + 1
         WHERE k.aggregate_type = r.t AND k.aggregate_id = r.i;
        aggregate_type := r.t;
        aggregate_id := r.i;
        RETURN NEXT;
    END LOOP;
END
$$;

-- The claim's parts. They only read. Their statements run on plans made once per
-- connection, held to index scans and nested loops: what a claim needs whatever the
-- tables' sizes (every read is by index, bounded by p_limit), and never a scan of a whole
-- table (a cached plan outlives the table size it was made for; 0005, 0013).

-- Keys to look at, in order, with each key's first candidate id (0 for keys looked at
-- whatever the cursor): keys named by the relay and keys with due scheduled rows first,
-- then those of the candidate rows (due at insert, pending, from the cursor, by id) in
-- order of their oldest candidate. Keys with a parked row are left out when
-- p_block_parked_keys. Also how far the scan got and how many candidates it read.
CREATE FUNCTION outbox_claim_keys(
    p_owned integer[],
    p_after bigint,
    p_before bigint,
    p_limit integer,
    p_block_parked_keys boolean,
    p_key_types text[],
    p_key_ids text[],
    p_held bigint[],
    OUT scanned_to bigint,
    OUT scanned integer,
    OUT key_types text[],
    OUT key_ids text[],
    OUT first_ids bigint[]
)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    v_all boolean := cardinality(p_owned) = 64;
BEGIN
    WITH cand AS (
        SELECT e.id, e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at <= e.created_at
           AND e.id > p_after
           AND (p_before IS NULL OR e.id <= p_before)
           AND NOT (e.id = ANY (p_held))
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (p_owned))
         ORDER BY e.id
         LIMIT p_limit
    ), due AS (
        -- Scheduled rows that are due, earliest first, for forward claims only, for at
        -- most half the claim; keys that stay blocked are left out here, so they cannot
        -- fill this half claim after claim.
        SELECT e.aggregate_type, e.aggregate_id
          FROM outbox_events e
         WHERE p_before IS NULL
           AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at > e.created_at
           AND e.available_at <= now()
           AND NOT (e.id = ANY (p_held))
           AND (v_all OR outbox_partition_of(e.aggregate_type, e.aggregate_id) = ANY (p_owned))
           AND NOT EXISTS (SELECT 1 FROM outbox_events x
                            WHERE p_block_parked_keys
                              AND x.aggregate_type = e.aggregate_type
                              AND x.aggregate_id = e.aggregate_id
                              AND x.parked_at IS NOT NULL)
         ORDER BY e.available_at, e.id
         LIMIT greatest(p_limit / 2, 1)
    ), keys AS (
        SELECT u.aggregate_type, u.aggregate_id, min(u.first_id) AS first_id
          FROM (SELECT c.aggregate_type, c.aggregate_id, c.id AS first_id FROM cand c
                UNION ALL
                SELECT n.aggregate_type, n.aggregate_id, 0::bigint
                  FROM unnest(p_key_types, p_key_ids) AS n(aggregate_type, aggregate_id)
                 WHERE v_all OR outbox_partition_of(n.aggregate_type, n.aggregate_id) = ANY (p_owned)
                UNION ALL
                SELECT d.aggregate_type, d.aggregate_id, 0::bigint FROM due d) u
         GROUP BY u.aggregate_type, u.aggregate_id
    )
    SELECT (SELECT max(c.id) FROM cand c),
           (SELECT count(*) FROM cand c),
           array_agg(k.aggregate_type ORDER BY k.first_id),
           array_agg(k.aggregate_id ORDER BY k.first_id),
           array_agg(k.first_id ORDER BY k.first_id)
      INTO scanned_to, scanned, key_types, key_ids, first_ids
      FROM keys k
     WHERE NOT EXISTS (SELECT 1 FROM outbox_events x
                        WHERE p_block_parked_keys
                          AND x.aggregate_type = k.aggregate_type
                          AND x.aggregate_id = k.aggregate_id
                          AND x.parked_at IS NOT NULL);
END
$$;

-- Each key's next rows in seq order, not held, at most p_per_key, keys in order, at most
-- p_limit rows in all; `cut` is the first candidate id of the first key that did not fit
-- (the cursor stops before it). A key's pending rows that the claim can see are a prefix
-- of its numbers: a lower number committed before a higher one was taken.
CREATE FUNCTION outbox_claim_pick(
    p_key_types text[],
    p_key_ids text[],
    p_first_ids bigint[],
    p_per_key integer,
    p_limit integer,
    p_held bigint[],
    OUT ids bigint[],
    OUT cut bigint
)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    WITH q AS (
        SELECT k.ord, k.first_id, x.id, x.seq
          FROM unnest(p_key_types, p_key_ids, p_first_ids) WITH ORDINALITY AS k(aggregate_type, aggregate_id, first_id, ord)
         CROSS JOIN LATERAL (
               SELECT e.id, e.seq
                 FROM outbox_events e
                WHERE e.aggregate_type = k.aggregate_type
                  AND e.aggregate_id = k.aggregate_id
                  AND e.dispatched_at IS NULL AND e.parked_at IS NULL
                  AND e.seq IS NOT NULL
                  AND NOT (e.id = ANY (p_held))
                ORDER BY e.seq
                LIMIT p_per_key) x
    ), n AS (
        SELECT q.*, row_number() OVER (ORDER BY q.ord, q.seq) AS n FROM q
    )
    SELECT array_agg(n.id ORDER BY n.n) FILTER (WHERE n.n <= p_limit),
           min(n.first_id) FILTER (WHERE n.n > p_limit AND n.first_id > 0)
      INTO ids, cut
      FROM n;
END
$$;

-- The rows to publish, in the order given, as the relay holds them: an oversized row
-- (larger than p_max_message_bytes) or an unreadable one (text that is not UTF-8, only in
-- a SQL_ASCII database) comes back without body, headers or trace context, to be parked;
-- rows stop once their sizes pass p_max_bytes (the first row always comes).
CREATE FUNCTION outbox_claim_rows(p_ids bigint[], p_max_message_bytes integer, p_max_bytes bigint)
RETURNS TABLE (
    id bigint, event_id uuid, aggregate_type text, aggregate_id text, event_type text,
    routing_key text, body text, body_bytes integer, headers text, traceparent text,
    tracestate text, created_epoch double precision, created_text text, attempts integer,
    seq bigint, partition integer, unreadable text
)
LANGUAGE plpgsql STABLE SET search_path FROM CURRENT SET plan_cache_mode = force_generic_plan
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    v_check boolean := current_setting('server_encoding') = 'SQL_ASCII';
BEGIN
    RETURN QUERY
    WITH r AS MATERIALIZED (
        SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type,
               coalesce(e.routing_key, e.aggregate_type || '.' || e.event_type) AS routing_key,
               e.payload::text AS body, e.headers::text AS headers, e.traceparent, e.tracestate,
               extract(epoch FROM e.created_at)::float8 AS created_epoch,
               to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS created_text,
               e.attempts, e.seq,
               outbox_partition_of(e.aggregate_type, e.aggregate_id) AS partition,
               p.ord
          FROM unnest(p_ids) WITH ORDINALITY AS p(id, ord)
          JOIN outbox_events e ON e.id = p.id
    ), checked AS (
        SELECT r.*,
               CASE WHEN v_check THEN
                   nullif(concat_ws(', ',
                       CASE WHEN NOT outbox_utf8_valid(r.aggregate_type) THEN 'aggregate_type' END,
                       CASE WHEN NOT outbox_utf8_valid(r.aggregate_id) THEN 'aggregate_id' END,
                       CASE WHEN NOT outbox_utf8_valid(r.event_type) THEN 'event_type' END,
                       CASE WHEN NOT outbox_utf8_valid(r.routing_key) THEN 'routing_key' END,
                       CASE WHEN NOT outbox_utf8_valid(r.body) THEN 'payload' END,
                       CASE WHEN NOT outbox_utf8_valid(r.headers) THEN 'headers' END,
                       CASE WHEN NOT outbox_utf8_valid(r.traceparent) THEN 'traceparent' END,
                       CASE WHEN NOT outbox_utf8_valid(r.tracestate) THEN 'tracestate' END), '')
               END AS bad
          FROM r
    ), measured AS (
        SELECT r.*,
               octet_length(r.aggregate_type) + octet_length(r.aggregate_id)
                 + octet_length(r.event_type) + octet_length(r.routing_key) AS key_bytes,
               outbox_message_bytes(r.aggregate_type, r.aggregate_id, r.event_type, r.routing_key,
                                    r.body, r.headers, r.traceparent, r.tracestate) AS message_bytes
          FROM checked r
    ), sized AS (
        SELECT m.*, m.message_bytes > p_max_message_bytes OR m.bad IS NOT NULL AS oversized,
               sum(CASE WHEN m.message_bytes > p_max_message_bytes OR m.bad IS NOT NULL THEN m.key_bytes
                        ELSE m.message_bytes END) OVER (ORDER BY m.ord) AS running
          FROM measured m
    )
    SELECT s.id, s.event_id,
           CASE WHEN s.bad IS NULL THEN s.aggregate_type ELSE encode(convert_to(s.aggregate_type, 'SQL_ASCII'), 'hex') END,
           CASE WHEN s.bad IS NULL THEN s.aggregate_id ELSE encode(convert_to(s.aggregate_id, 'SQL_ASCII'), 'hex') END,
           CASE WHEN s.bad IS NULL THEN s.event_type ELSE '' END,
           CASE WHEN s.bad IS NULL THEN s.routing_key ELSE '' END,
           CASE WHEN s.oversized THEN NULL ELSE s.body END,
           s.message_bytes,
           CASE WHEN s.oversized THEN NULL ELSE s.headers END,
           CASE WHEN s.oversized THEN NULL ELSE s.traceparent END,
           CASE WHEN s.oversized THEN NULL ELSE s.tracestate END,
           s.created_epoch, s.created_text, s.attempts, s.seq, s.partition,
           CASE WHEN s.bad IS NOT NULL THEN 'unreadable row: ' || s.bad || ' not valid UTF-8' END
      FROM sized s
     WHERE s.ord = 1 OR s.running <= p_max_bytes
     ORDER BY s.ord;
END
$$;

-- The claim: its parts in order. Same arguments and result as before (a relay of the
-- previous version calls it too); replaced in place, keeps its grants. The first row says
-- where the scan got to (scanned_to, scanned, per_key, next_due), the others are rows.
-- Reads only, unless a due row has no number yet (outbox_number_due) or the statistics
-- are stale (outbox_refresh_statistics, see 0007).
CREATE OR REPLACE FUNCTION outbox_claim(
    p_relay text,
    p_after bigint,
    p_limit integer,
    p_per_key integer,
    p_block_parked_keys boolean,
    p_max_message_bytes integer,
    p_max_bytes bigint,
    p_key_types text[] DEFAULT '{}',
    p_key_ids text[] DEFAULT '{}',
    p_before bigint DEFAULT NULL,
    p_held bigint[] DEFAULT '{}'
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
    per_key integer,
    next_due double precision,
    unreadable text
)
LANGUAGE plpgsql SET search_path FROM CURRENT SET plan_cache_mode = force_custom_plan
    SET enable_seqscan = on SET enable_bitmapscan = on SET enable_hashjoin = on SET enable_mergejoin = on
AS $$
#variable_conflict use_column
DECLARE
    v_owned    integer[];
    v_types    text[] := p_key_types;
    v_ids      text[] := p_key_ids;
    v_keys     record;
    v_pick     record;
    v_per_key  integer;
    v_next_due double precision;
BEGIN
    -- A takeover (outbox_lease) takes this lock exclusively: the partitions read here stay
    -- this relay's until the claim ends.
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());

    SELECT array_agg(p.partition) INTO v_owned
      FROM outbox_partitions p
     WHERE p.owner = p_relay AND p.lease_until > clock_timestamp();
    IF v_owned IS NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                            NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                            NULL::integer, p_after, 0, 0, NULL::float8, NULL::text;
        RETURN;
    END IF;

    IF p_before IS NULL THEN
        SELECT v_types || coalesce(array_agg(d.aggregate_type), '{}'),
               v_ids || coalesce(array_agg(d.aggregate_id), '{}')
          INTO v_types, v_ids
          FROM outbox_number_due(v_owned, p_limit) d;
    END IF;

    SELECT * INTO v_keys
      FROM outbox_claim_keys(v_owned, p_after, p_before, p_limit, p_block_parked_keys,
                             v_types, v_ids, p_held);
    IF v_keys.scanned >= least(p_limit, 256) THEN
        PERFORM outbox_refresh_statistics(v_keys.scanned);  -- see "Statistics" in 0007
    END IF;

    -- Spread p_limit over the keys waiting: shallow prefixes for many keys, deep for few.
    v_per_key := greatest(1, least(p_per_key,
        ceil(p_limit::numeric / greatest(coalesce(cardinality(v_keys.key_types), 0), 1))::integer));
    SELECT * INTO v_pick
      FROM outbox_claim_pick(v_keys.key_types, v_keys.key_ids, v_keys.first_ids, v_per_key,
                             p_limit, p_held);

    -- When the earliest scheduled row not yet due becomes due (seconds from now), so that
    -- the relay claims then instead of at its next poll. Forward claims only.
    IF p_before IS NULL THEN
        SELECT extract(epoch FROM min(e.available_at) - now())::float8 INTO v_next_due
          FROM outbox_events e
         WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND e.available_at > e.created_at
           AND e.available_at > now();
    END IF;

    RETURN QUERY SELECT NULL::bigint, NULL::uuid, NULL, NULL, NULL, NULL, NULL, NULL::integer,
                        NULL, NULL, NULL, NULL::float8, NULL, NULL::integer, NULL::bigint,
                        NULL::integer,
                        coalesce(v_pick.cut - 1, v_keys.scanned_to, p_after),
                        coalesce(v_keys.scanned, 0), v_per_key, v_next_due, NULL::text;
    RETURN QUERY
    SELECT r.id, r.event_id, r.aggregate_type, r.aggregate_id, r.event_type, r.routing_key,
           r.body, r.body_bytes, r.headers, r.traceparent, r.tracestate, r.created_epoch,
           r.created_text, r.attempts, r.seq, r.partition,
           NULL::bigint, NULL::integer, NULL::integer, NULL::float8, r.unreadable
      FROM outbox_claim_rows(v_pick.ids, p_max_message_bytes, p_max_bytes) r;
END
$$;

-- Failures and parks as before (fenced on the lease, every id answered), without the
-- block-key rewind: the key's later rows keep their numbers and wait behind the parked
-- row; its counter records the parked seq for the re-drive. Replaced in place.
CREATE OR REPLACE FUNCTION outbox_record_failures(
    p_ids bigint[],
    p_reasons text[],
    p_kinds smallint[],
    p_max_attempts integer,
    p_block_key boolean,
    p_relay text,
    p_partitions integer[],
    p_epochs bigint[]
) RETURNS TABLE (id bigint, attempts integer, parked boolean, outcome text)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock_shared(outbox_claim_lock_key());
    RETURN QUERY
    WITH mine AS (
        SELECT p.partition
          FROM outbox_partitions p, unnest(p_partitions, p_epochs) AS l(partition, epoch)
         WHERE p.partition = l.partition AND p.epoch = l.epoch
           AND p.owner = p_relay AND p.lease_until > clock_timestamp()
    ), f AS (
        SELECT * FROM unnest(p_ids, p_reasons, p_kinds) AS f(id, reason, kind)
    ), u AS (
        UPDATE outbox_events e
           SET attempts = e.attempts + 1,
               last_error = f.reason,
               parked_at = CASE WHEN f.kind = 2 OR (f.kind = 1 AND e.attempts + 1 >= p_max_attempts)
                                THEN now() END
          FROM f
         WHERE e.id = f.id AND e.dispatched_at IS NULL AND e.parked_at IS NULL
           AND outbox_partition_of(e.aggregate_type, e.aggregate_id) IN (SELECT m.partition FROM mine m)
        RETURNING e.id, e.aggregate_type, e.aggregate_id, e.seq, e.attempts,
                  e.parked_at IS NOT NULL AS parked
    ), blocked AS (
        UPDATE outbox_key_seq k SET blocked_seq = u.seq
          FROM u
         WHERE p_block_key AND u.parked
           AND k.aggregate_type = u.aggregate_type AND k.aggregate_id = u.aggregate_id
        RETURNING k.aggregate_type
    )
    SELECT u.id, u.attempts, u.parked, 'recorded'::text FROM u
    UNION ALL
    SELECT f.id, coalesce(e.attempts, 0), coalesce(e.parked_at IS NOT NULL, false),
           CASE WHEN e.id IS NULL THEN 'gone'
                WHEN outbox_partition_of(e.aggregate_type, e.aggregate_id) NOT IN (SELECT m.partition FROM mine m)
                     THEN 'fenced'
                WHEN e.dispatched_at IS NOT NULL THEN 'dispatched'
                WHEN e.parked_at IS NOT NULL THEN 'parked'
                ELSE 'gone' END
      FROM f LEFT JOIN outbox_events e ON e.id = f.id
     WHERE NOT EXISTS (SELECT 1 FROM u WHERE u.id = f.id);
END
$$;

-- Re-drive: parked rows back to pending, attempts reset. A key's re-driven rows keep
-- their numbers unless another row of the key has a higher one that went out or may be
-- going out (dispatched, parked, or pending, except behind a block-key park of this very
-- row: those waited and never went out); then they get the key's next numbers, in the
-- order they had, under the key's counter (which never goes below a published number).
-- Same arguments and result; replaced in place.
CREATE OR REPLACE FUNCTION outbox_redrive(p_ids bigint[], p_dry_run boolean DEFAULT false)
RETURNS TABLE (id bigint, event_id uuid, aggregate_type text, aggregate_id text, seq_before bigint, renumbered boolean)
LANGUAGE plpgsql SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    k       record;
    v_base  bigint;
    v_ids   bigint[] := '{}';
    v_seqs  bigint[] := '{}';
    v_renum boolean[] := '{}';
BEGIN
    FOR k IN
        WITH sel AS (
            SELECT e.id, e.aggregate_type, e.aggregate_id, e.seq
              FROM outbox_events e
             WHERE e.id = ANY (p_ids) AND e.parked_at IS NOT NULL
        ), plan AS (
            SELECT s.*, s.seq IS NULL OR EXISTS (
                       SELECT 1 FROM outbox_events o
                        WHERE o.aggregate_type = s.aggregate_type AND o.aggregate_id = s.aggregate_id
                          AND o.seq > s.seq AND NOT (o.id = ANY (p_ids))
                          AND (o.dispatched_at IS NOT NULL OR o.parked_at IS NOT NULL
                               OR NOT EXISTS (SELECT 1 FROM outbox_key_seq c
                                               WHERE c.aggregate_type = s.aggregate_type
                                                 AND c.aggregate_id = s.aggregate_id
                                                 AND c.blocked_seq = s.seq))) AS renumber
              FROM sel s
        )
        SELECT p.aggregate_type AS t, p.aggregate_id AS i, bool_or(p.renumber) AS renumber,
               array_agg(p.id ORDER BY p.seq NULLS LAST, p.id) AS ids,
               array_agg(p.seq ORDER BY p.seq NULLS LAST, p.id) AS seqs
          FROM plan p
         GROUP BY p.aggregate_type, p.aggregate_id
         ORDER BY p.aggregate_type, p.aggregate_id
    LOOP
        v_ids := v_ids || k.ids;
        v_seqs := v_seqs || k.seqs;
        v_renum := v_renum || array_fill(k.renumber, ARRAY[cardinality(k.ids)]);
        CONTINUE WHEN p_dry_run;
        v_base := NULL;
        IF k.renumber THEN
            UPDATE outbox_key_seq c
               SET last_seq = greatest(c.last_seq,
                                       coalesce((SELECT max(o.seq) FROM outbox_events o
                                                  WHERE o.aggregate_type = k.t AND o.aggregate_id = k.i), 0))
                              + cardinality(k.ids),
                   blocked_seq = NULL
             WHERE c.aggregate_type = k.t AND c.aggregate_id = k.i
            RETURNING c.last_seq - cardinality(k.ids) INTO v_base;
            IF v_base IS NULL THEN
                INSERT INTO outbox_key_seq (aggregate_type, aggregate_id, last_seq)
                SELECT k.t, k.i, coalesce(max(o.seq), 0) + cardinality(k.ids)
                  FROM outbox_events o WHERE o.aggregate_type = k.t AND o.aggregate_id = k.i
                RETURNING last_seq - cardinality(k.ids) INTO v_base;
            END IF;
        ELSE
            UPDATE outbox_key_seq c SET blocked_seq = NULL
             WHERE c.aggregate_type = k.t AND c.aggregate_id = k.i AND c.blocked_seq IS NOT NULL;
        END IF;
        UPDATE outbox_events e
           SET parked_at = NULL,
               attempts = 0,
               seq = CASE WHEN k.renumber THEN v_base + array_position(k.ids, e.id) ELSE e.seq END
         WHERE e.id = ANY (k.ids);
    END LOOP;

    RETURN QUERY
    SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, x.seq_before, x.renumbered
      FROM unnest(v_ids, v_seqs, v_renum) AS x(id, seq_before, renumbered)
      JOIN outbox_events e ON e.id = x.id
     ORDER BY e.id;

    IF NOT p_dry_run THEN
        PERFORM pg_notify('outbox_events:' || current_schema(), '');
    END IF;
END
$$;
